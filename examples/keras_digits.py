"""Data-parallel Keras 3 training on scikit-learn's digits with hvddp.

One script for every Keras backend; pick it with KERAS_BACKEND:

    KERAS_BACKEND=tensorflow mpiexec -n 2 python -m mpi4py examples/keras_digits.py
    KERAS_BACKEND=torch      mpiexec -n 2 python -m mpi4py examples/keras_digits.py
    KERAS_BACKEND=jax        mpiexec -n 2 python -m mpi4py examples/keras_digits.py

Every rank trains on its own shard of the training set; hvddp averages the gradients, so all
replicas stay identical. Rank 0 alone shows the progress bar and writes the checkpoint.
"""

import argparse
import os
import time

import keras
import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import hvddp.keras as hvd


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=1e-3, help="for one rank; scaled by the number of ranks")
    parser.add_argument("--checkpoint", default=os.path.join("checkpoints", "keras_digits.keras"),
                        help="where rank 0 saves the model after every epoch")
    args = parser.parse_args()

    hvd.init()
    keras.utils.set_random_seed(1234 + hvd.rank())  # different on purpose: the broadcast equalises

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype("float32")
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)
    rows = len(x_train) - len(x_train) % hvd.size()  # equal shards: the same number of steps everywhere
    x_shard, y_shard = x_train[hvd.rank():rows:hvd.size()], y_train[hvd.rank():rows:hvd.size()]

    model = keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dropout(0.1),
        keras.layers.Dense(10, activation="softmax"),
    ])
    lr = args.lr * hvd.size()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(lr)),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])

    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),  # start every replica from rank 0's weights
        hvd.callbacks.MetricAverageCallback(),  # epoch metrics averaged over ranks
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=lr, warmup_epochs=3),
    ]
    if hvd.rank() == 0:
        os.makedirs(os.path.dirname(os.path.abspath(args.checkpoint)), exist_ok=True)
        callbacks.append(keras.callbacks.ModelCheckpoint(args.checkpoint))

    start = time.perf_counter()
    model.fit(x_shard, y_shard, batch_size=args.batch_size, epochs=args.epochs, callbacks=callbacks,
              verbose=1 if hvd.rank() == 0 else 0)
    seconds = time.perf_counter() - start

    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    weights = np.concatenate([w.ravel() for w in model.get_weights()])
    every = np.asarray(hvd.allgather(weights[None, :], name="replicas"))
    if hvd.rank() == 0:
        print(f"backend: {keras.backend.backend()}  ranks: {hvd.size()}  test accuracy: {accuracy:.4f}  "
              f"training time: {seconds:.1f} s  replicas identical: {bool((every == every[0]).all())}  "
              f"checkpoint: {args.checkpoint}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
