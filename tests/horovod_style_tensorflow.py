"""A Horovod TensorFlow 2 training loop, written as Horovod's examples/tensorflow2/tensorflow2_mnist.py is.

The only hvddp-specific line is the import (``import horovod.tensorflow as hvd`` before).
Changed for Keras 3, which any port to it needs with or without hvddp: an optimizer's variables
are the property ``opt.variables`` (Keras 2's was the method ``opt.variables()``). The data are
scikit-learn's digits instead of MNIST so that nothing is downloaded, and the end adds a held-out
evaluation and a check that the replicas agree, for tests/test_tensorflow.py, which runs it under
``mpiexec -n 2``.
"""
import argparse
import os

import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import hvddp.tensorflow as hvd

parser = argparse.ArgumentParser(description='TensorFlow 2 digits Example')
parser.add_argument('--steps', type=int, default=1200)
parser.add_argument('--checkpoint-dir', default='./checkpoints')
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
    tf.keras.layers.MaxPooling2D(pool_size=(2, 2)),
    tf.keras.layers.Flatten(),
    tf.keras.layers.Dense(64, activation='relu'),
    tf.keras.layers.Dense(10, activation='softmax')
])
loss = tf.losses.SparseCategoricalCrossentropy()

# Horovod: adjust learning rate based on number of GPUs.
opt = tf.optimizers.Adam(0.001 * hvd.size())

checkpoint = tf.train.Checkpoint(model=digits_model, optimizer=opt)


@tf.function
def training_step(images, labels, first_batch):
    with tf.GradientTape() as tape:
        probs = digits_model(images, training=True)
        loss_value = loss(labels, probs)

    # Horovod: add Horovod Distributed GradientTape.
    tape = hvd.DistributedGradientTape(tape)

    grads = tape.gradient(loss_value, digits_model.trainable_variables)
    opt.apply_gradients(zip(grads, digits_model.trainable_variables))

    # Horovod: broadcast initial variable states from rank 0 to all other processes.
    # This is necessary to ensure consistent initialization of all workers when
    # training is started with random weights or restored from a checkpoint.
    #
    # Note: broadcast should be done after the first gradient step to ensure optimizer
    # initialization.
    if first_batch:
        hvd.broadcast_variables(digits_model.variables, root_rank=0)
        hvd.broadcast_variables(opt.variables, root_rank=0)

    return loss_value


# Horovod: adjust number of steps based on number of GPUs.
for batch, (images, labels) in enumerate(dataset.take(args.steps // hvd.size())):
    loss_value = training_step(images, labels, batch == 0)

    if batch % 100 == 0 and hvd.local_rank() == 0:
        print('Step #%d\tLoss: %.6f' % (batch, loss_value))

# Horovod: save checkpoints only on worker 0 to prevent other workers from
# corrupting it.
if hvd.rank() == 0:
    checkpoint.save(os.path.join(args.checkpoint_dir, 'ckpt'))

probs = digits_model(x_test[..., np.newaxis], training=False)
accuracy = float(np.mean(np.argmax(probs, axis=1) == y_test))
weights = [float(np.sum(np.abs(w))) for w in digits_model.get_weights()]
identical = all(w == weights for w in hvd.allgather_object(weights))
if hvd.rank() == 0:
    print('ranks: %d  test accuracy: %.4f  replicas identical: %s' % (hvd.size(), accuracy, identical))
