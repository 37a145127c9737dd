"""A Horovod TensorFlow 2 Keras script, written as Horovod's examples/tensorflow2/tensorflow2_keras_mnist.py is.

The only hvddp-specific line is the import (``import horovod.tensorflow.keras as hvd`` before).
Changed for Keras 3, which any port to it needs with or without hvddp: no
``experimental_run_tf_function`` in ``compile`` (Keras 3 has none) and a ``.keras`` checkpoint
file (Keras 3 refuses ``.h5`` for whole models). The data are scikit-learn's digits instead of
MNIST so that nothing is downloaded, and the end adds a held-out evaluation and a check that the
replicas agree, for tests/test_keras.py, which runs it under ``mpiexec -n 2``.
"""
import argparse
import os

import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import hvddp.tensorflow.keras as hvd

parser = argparse.ArgumentParser(description='TensorFlow 2 Keras digits Example')
parser.add_argument('--epochs', type=int, default=6)
parser.add_argument('--checkpoint-dir', default='.')
args = parser.parse_args()

# Horovod: initialize Horovod.
hvd.init()

# Horovod: pin GPU to be used to process local rank (one GPU per process)
gpus = tf.config.experimental.list_physical_devices('GPU')
for gpu in gpus:
    tf.config.experimental.set_memory_growth(gpu, True)
if gpus:
    tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], 'GPU')

digits = load_digits()
x_train, x_test, y_train, y_test = train_test_split(
    digits.images.astype(np.float32) / 16.0, digits.target, test_size=0.25, random_state=0)

dataset = tf.data.Dataset.from_tensor_slices(
    (tf.cast(x_train[..., tf.newaxis], tf.float32),
     tf.cast(y_train, tf.int64))
)
dataset = dataset.repeat().shuffle(1000).batch(32)

digits_model = tf.keras.Sequential([
    tf.keras.layers.Input((8, 8, 1)),
    tf.keras.layers.Conv2D(16, [3, 3], activation='relu', padding='same'),
    tf.keras.layers.Conv2D(32, [3, 3], activation='relu', padding='same'),
    tf.keras.layers.MaxPooling2D(pool_size=(2, 2)),
    tf.keras.layers.Dropout(0.25),
    tf.keras.layers.Flatten(),
    tf.keras.layers.Dense(64, activation='relu'),
    tf.keras.layers.Dropout(0.5),
    tf.keras.layers.Dense(10, activation='softmax')
])

# Horovod: adjust learning rate based on number of GPUs.
scaled_lr = 0.002 * hvd.size()
opt = tf.optimizers.Adam(scaled_lr)

# Horovod: add Horovod DistributedOptimizer.
opt = hvd.DistributedOptimizer(
    opt, backward_passes_per_step=1, average_aggregated_gradients=True)

digits_model.compile(loss=tf.losses.SparseCategoricalCrossentropy(),
                     optimizer=opt,
                     metrics=['accuracy'])

callbacks = [
    # Horovod: broadcast initial variable states from rank 0 to all other processes.
    hvd.callbacks.BroadcastGlobalVariablesCallback(0),

    # Horovod: average metrics among workers at the end of every epoch.
    hvd.callbacks.MetricAverageCallback(),

    # Horovod: using `lr = 1.0 * hvd.size()` from the very beginning leads to worse final
    # accuracy. Scale the learning rate `lr = 1.0` ---> `lr = 1.0 * hvd.size()` during
    # the first three epochs.
    hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=3, verbose=1),
]

# Horovod: save checkpoints only on worker 0 to prevent other workers from corrupting them.
if hvd.rank() == 0:
    callbacks.append(tf.keras.callbacks.ModelCheckpoint(
        os.path.join(args.checkpoint_dir, 'checkpoint-{epoch}.keras')))

# Horovod: write logs on worker 0.
verbose = 2 if hvd.rank() == 0 else 0

# Train the model.
# Horovod: adjust number of steps based on number of GPUs.
digits_model.fit(dataset, steps_per_epoch=400 // hvd.size(), callbacks=callbacks, epochs=args.epochs,
                 verbose=verbose)

_, accuracy = digits_model.evaluate(x_test[..., np.newaxis], y_test, verbose=0)
weights = [float(np.sum(np.abs(w))) for w in digits_model.get_weights()]
identical = all(w == weights for w in hvd.allgather_object(weights))
if hvd.rank() == 0:
    print('ranks: %d  test accuracy: %.4f  replicas identical: %s' % (hvd.size(), accuracy, identical))
