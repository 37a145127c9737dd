"""Distributed least squares with hvddp's numpy core on scikit-learn's diabetes data.

Each rank holds a shard of the rows, computes its gradient of the mean squared error, and
hvddp averages the gradients, so every rank takes the same gradient-descent step. The result is
compared with one process taking the same steps on all the rows (the weights agree to rounding)
and with the closed-form solution (the mean squared error; the weights themselves converge
slowly along the data's nearly collinear features).

    mpiexec -n 2 python -m mpi4py examples/numpy_least_squares.py [--steps 3000] [--lr 0.5]
"""

import argparse

import numpy as np
from sklearn.datasets import load_diabetes

import hvddp


def main(steps: int = 3000, lr: float = 0.5) -> None:
    hvddp.init()
    x, y = load_diabetes(return_X_y=True)
    x = (x - x.mean(0)) / x.std(0)
    x = np.hstack([x, np.ones((len(x), 1))])
    # Every rank takes its own rows; equal shard sizes keep the average of means exact.
    rows = len(x) - len(x) % hvddp.size()
    shard = slice(hvddp.rank(), rows, hvddp.size())
    xs, ys = x[shard], y[shard]
    w = hvddp.broadcast(np.random.default_rng(hvddp.rank()).normal(size=x.shape[1]), root_rank=0,
                        name="w0")
    for step in range(steps):
        grad = 2.0 / len(xs) * xs.T @ (xs @ w - ys)
        w -= lr / 10 * hvddp.allreduce(grad, name="grad")
    loss = hvddp.allreduce(np.array(np.mean((xs @ w - ys) ** 2)), name="loss")
    exact, *_ = np.linalg.lstsq(x[:rows], y[:rows], rcond=None)
    exact_loss = np.mean((x[:rows] @ exact - y[:rows]) ** 2)
    same = hvddp.allgather(w[None, :], name="replicas")
    if hvddp.rank() == 0:
        alone = np.random.default_rng(0).normal(size=x.shape[1])  # rank 0's start, which every rank got
        for step in range(steps):
            alone -= lr / 10 * 2.0 / rows * x[:rows].T @ (x[:rows] @ alone - y[:rows])
        print(f"ranks: {hvddp.size()}  distributed MSE: {float(loss):.2f}  closed form: {exact_loss:.2f}  "
              f"max |w - one process|: {np.abs(w - alone).max():.2g}  replicas identical: "
              f"{bool((same == same[0]).all())}")
    hvddp.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000, help="gradient-descent steps")
    parser.add_argument("--lr", type=float, default=0.5, help="step size (times 1/10)")
    args = parser.parse_args()
    main(args.steps, args.lr)
