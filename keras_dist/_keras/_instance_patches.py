"""Methods replaced on one Keras object for a block, without touching its class.

Two hooks need a Keras object to behave differently for a while: ``fit``'s
replica step scales the loss the optimizer differentiates (``scale_loss``), and
``ModelCheckpoint`` makes ``model.save``/``save_weights`` write atomically. The
replacement goes into the instance's ``__dict__``, where attribute lookup finds
it before the class's method; Keras's attribute tracking (``__setattr__``) is
not involved, and removing it restores the class's method.

>>> import keras
>>> optimizer = keras.optimizers.SGD()
>>> with replaced_methods(optimizer, {"scale_loss": lambda loss: loss * 2}):
...     optimizer.scale_loss(3.0)
6.0
>>> optimizer.scale_loss(3.0)
3.0
"""

import contextlib


@contextlib.contextmanager
def replaced_methods(obj, replacements: dict):
    """Within the block, ``obj.<name>`` is ``replacements[name]`` (the class is untouched)."""
    for name, method in replacements.items():
        obj.__dict__[name] = method
    try:
        yield obj
    finally:
        for name in replacements:
            obj.__dict__.pop(name, None)
