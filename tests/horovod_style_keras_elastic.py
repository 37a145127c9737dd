"""A Horovod elastic Keras script, written as Horovod's examples/elastic/tensorflow2/tensorflow2_keras_mnist_elastic.py is.

The only hvddp-specific line is the import (``import horovod.tensorflow.keras as hvd`` before).
Under ``mpiexec`` the ranks are fixed: ``hvd.elastic.run`` syncs the state from rank 0 and trains;
the commit callbacks run and never see a reset. Changed for Keras 3, which any port to it needs
with or without hvddp: no ``experimental_run_tf_function`` in ``compile``, a ``.keras``
checkpoint name, and the reset callback assigns ``learning_rate`` (Keras 3 has no
``backend.set_value``). The data are scikit-learn's digits instead of MNIST, the model a small
MLP, and the end adds a held-out evaluation and a check that the replicas agree, for
tests/test_keras.py, which runs it under ``mpiexec -n 2``.
"""
import argparse
import os

import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import hvddp.tensorflow.keras as hvd

parser = argparse.ArgumentParser(description='TensorFlow 2 Keras digits elastic Example')
parser.add_argument('--epochs', type=int, default=5)
parser.add_argument('--checkpoint-dir', default='.')
args = parser.parse_args()

# Horovod: initialize Horovod.
hvd.init()

lr = 0.002
batch_size = 32

x, y = load_digits(return_X_y=True)
x_train, x_test, y_train, y_test = train_test_split((x / 16.0).astype(np.float32), y, test_size=0.25,
                                                    random_state=1)
dataset = tf.data.Dataset.from_tensor_slices((x_train, y_train.astype(np.int64)))
dataset = dataset.repeat().shuffle(1000).batch(batch_size)

model = tf.keras.Sequential([
    tf.keras.layers.Input((64,)),
    tf.keras.layers.Dense(128, activation='relu'),
    tf.keras.layers.Dense(10, activation='softmax')
])

# Horovod: adjust learning rate based on number of workers.
scaled_lr = lr * hvd.size()
opt = tf.optimizers.Adam(scaled_lr)

# Horovod: add Horovod DistributedOptimizer.
opt = hvd.DistributedOptimizer(opt)

model.compile(loss=tf.losses.SparseCategoricalCrossentropy(), optimizer=opt, metrics=['accuracy'])


def on_state_reset():
    # Horovod: scale the learning rate by the new number of workers.
    state.model.optimizer.learning_rate.assign(lr * hvd.size())


state = hvd.elastic.KerasState(model, batch=0, epoch=0)
state.register_reset_callbacks([on_state_reset])

callbacks = [
    # Horovod: average metrics among workers at the end of every epoch.
    hvd.callbacks.MetricAverageCallback(),

    # Horovod: elastic training callbacks to update and commit state.
    hvd.elastic.UpdateEpochStateCallback(state),
    hvd.elastic.UpdateBatchStateCallback(state),
    hvd.elastic.CommitStateCallback(state, batches_per_commit=10),
]

# Horovod: save checkpoints only on worker 0 to prevent other workers from corrupting them.
if hvd.rank() == 0:
    callbacks.append(tf.keras.callbacks.ModelCheckpoint(
        os.path.join(args.checkpoint_dir, 'checkpoint-{epoch}.keras')))

# Horovod: write logs on worker 0.
verbose = 2 if hvd.rank() == 0 else 0


# Train the model.
# Horovod: the training will stop once the number of epochs is reached.
@hvd.elastic.run
def train(state):
    state.model.fit(dataset, steps_per_epoch=300 // hvd.size(), callbacks=callbacks,
                    epochs=args.epochs - state.epoch, verbose=verbose)


train(state)

_, accuracy = model.evaluate(x_test, y_test, verbose=0)
weights = [float(np.sum(np.abs(w))) for w in model.get_weights()]
identical = all(w == weights for w in hvd.allgather_object(weights))
if hvd.rank() == 0:
    print('ranks: %d  epochs: %d  test accuracy: %.4f  replicas identical: %s' % (
        hvd.size(), state.epoch, accuracy, identical))
