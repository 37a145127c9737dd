"""Data-parallel custom TensorFlow training loop on scikit-learn's digits with hvddp.

    mpiexec -n 2 python -m mpi4py examples/tensorflow_digits.py

Each rank trains on its own shard; ``DistributedGradientTape`` averages the gradients inside
the ``tf.function`` step, so all replicas stay identical. Rank 0 reports progress and saves a
checkpoint (``--checkpoint``, default ``checkpoints/tensorflow_digits.weights.h5``).
"""

import argparse
import os
import time

import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import hvddp.tensorflow as hvd


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=1e-3, help="for one rank; scaled by the number of ranks")
    parser.add_argument("--checkpoint", default=os.path.join("checkpoints", "tensorflow_digits.weights.h5"))
    args = parser.parse_args()

    hvd.init()
    tf.random.set_seed(1234 + hvd.rank())  # different on purpose: the broadcast equalises

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype("float32")
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)
    rows = len(x_train) - len(x_train) % hvd.size()  # equal shards: the same number of steps everywhere
    shard = tf.data.Dataset.from_tensor_slices((x_train[hvd.rank():rows:hvd.size()],
                                                y_train[hvd.rank():rows:hvd.size()]))

    model = tf.keras.Sequential([
        tf.keras.Input((64,)),
        tf.keras.layers.Dense(128, activation="relu"),
        tf.keras.layers.Dense(10),
    ])
    optimizer = tf.keras.optimizers.Adam(args.lr * hvd.size())
    optimizer.build(model.trainable_variables)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    # Start every replica from rank 0's weights and optimizer state.
    hvd.broadcast_variables(model.variables + optimizer.variables, root_rank=0)

    @tf.function
    def train_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    start = time.perf_counter()
    for epoch in range(args.epochs):
        batches = shard.shuffle(len(x_train), seed=epoch).batch(args.batch_size)
        losses = [train_step(xb, yb) for xb, yb in batches]
        mean_loss = hvd.allreduce(tf.reduce_mean(losses), name="epoch_loss")  # averaged over ranks
        if hvd.rank() == 0:
            print(f"epoch {epoch + 1}/{args.epochs}  loss {float(mean_loss):.4f}")
            os.makedirs(os.path.dirname(os.path.abspath(args.checkpoint)), exist_ok=True)
            model.save_weights(args.checkpoint)

    seconds = time.perf_counter() - start
    accuracy = float(np.mean(np.argmax(model(x_test).numpy(), axis=1) == y_test))
    weights = np.concatenate([w.numpy().ravel() for w in model.trainable_variables])
    every = hvd.allgather(tf.constant(weights[None, :]), name="replicas").numpy()
    if hvd.rank() == 0:
        print(f"ranks: {hvd.size()}  test accuracy: {accuracy:.4f}  training time: {seconds:.1f} s  "
              f"replicas identical: {bool((every == every[0]).all())}  checkpoint: {args.checkpoint}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
