"""Distributed least squares with hvddp's numpy core on scikit-learn's diabetes data.

Each rank holds a shard of the rows, computes its gradient of the mean squared error, and
hvddp averages the gradients, so every rank takes the same gradient-descent step. The result is
compared with the closed-form solution on the full data.

    mpiexec -n 2 python -m mpi4py examples/numpy_least_squares.py
"""

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
        print(f"ranks: {hvddp.size()}  distributed MSE: {float(loss):.2f}  closed form: {exact_loss:.2f}  "
              f"max |w - exact|: {np.abs(w - exact).max():.3g}  replicas identical: "
              f"{bool((same == same[0]).all())}")
    hvddp.shutdown()


if __name__ == "__main__":
    main()
