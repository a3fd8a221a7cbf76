"""The arguments of a Keras loop under a strategy, before the loop reads them: each input
with its auto-shard policy, the steps an input built on the workers needs, and tf-keras's
``steps=-1`` (read to the end).
"""

import numbers


def apply_auto_shard_policies(arguments, strategy, training, loop) -> None:
    """Inputs carrying an auto-shard policy, as the loop reads them (``fit`` shuffles
    its ``x`` unless told not to, as Keras does)."""
    shuffle = {"x": arguments.get("shuffle", loop == "fit"), "validation_data": False}
    for name in ("x", "validation_data"):
        if arguments.get(name) is not None:
            steps = next((arguments[s] for s in _STEPS_FOR[name] if s in arguments), None)
            steps_name = _STEPS_FOR[name][0 if loop == "fit" or name != "x" else 1]
            arguments[name] = training.loop_input(
                arguments[name], strategy, shuffle[name], steps, (name, steps_name)
            )


# Which argument gives the number of steps for an input, per loop argument.
_STEPS_FOR = {"x": ("steps_per_epoch", "steps"), "validation_data": ("validation_steps",)}


def require_steps_for_endless_inputs(arguments) -> None:
    """TF's rule: an input built on the workers has no length, so the steps must be given."""
    for name, steps_names in _STEPS_FOR.items():
        data = arguments.get(name)
        if not getattr(data, "keras_dist_needs_steps", False):
            continue
        if not any(arguments.get(s) is not None for s in steps_names if s in arguments):
            raise ValueError(
                "When using a `tf.keras.utils.experimental.DatasetCreator`, "
                "`steps_per_epoch`, `validation_steps`, `steps`, or "
                "`pss_evaluation_shards` argument must be provided in `Model.fit`, "
                "`Model.evaluate`, or `Model.predict`. Received: "
                f"{name}={type(data).__name__} without {' or '.join(steps_names)}"
            )


def read_to_the_end(arguments) -> None:
    """tf-keras's ``steps=-1``: the input is read until it ends, as without steps.

    Keras 3 counts -1 as a number of steps: callbacks saw batch -2, the progress
    bar -1 steps, and each epoch ended in "Your input ran out of data". An input
    that never ends is read without end, as tf-keras's ("The training loop will
    run indefinitely"); ``loop_input`` has already taken -1 for such inputs.
    """
    for names in _STEPS_FOR.values():
        for name in names:
            if name in arguments and _is_minus_one(arguments[name]):
                arguments[name] = None


def _is_minus_one(steps) -> bool:
    return isinstance(steps, numbers.Integral) and int(steps) == -1
