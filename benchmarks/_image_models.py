"""The small image classifier of the ``fit`` benchmarks: 32x32x3 inputs, 10 classes.

Import it after ``KERAS_BACKEND`` is set (the scripts set it first).
"""

import keras


def image_classifier(kind: str) -> keras.Sequential:
    """``"cnn"``: two 3x3 convolutions of 16 filters and global pooling; ``"mlp"``: a
    hidden Dense layer of 512. Not compiled; built inside a strategy's scope, it is
    distributed."""
    if kind == "cnn":
        layers = [
            keras.layers.Conv2D(16, 3, activation="relu"),
            keras.layers.Conv2D(16, 3, activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
        ]
    else:
        layers = [keras.layers.Flatten(), keras.layers.Dense(512, activation="relu")]
    return keras.Sequential([keras.Input((32, 32, 3)), *layers, keras.layers.Dense(10)])
