"""Horovod's Adasum in float64, written out independently of hvddp, for the rank-side tests.

Level 1 pairs ranks (0, 1), (2, 3), ...; then pairs of pairs; a, b -> (1 - a.b/2|a|^2) a +
(1 - a.b/2|b|^2) b, a coefficient of 1 where |a|^2 < sqrt(DBL_MIN).
"""

import numpy as np


def adasum_reference(per_rank):
    """The Adasum of ``per_rank`` (arrays of one shape, one per rank, in rank order), in float64."""
    tiny = np.sqrt(np.finfo(np.float64).tiny)
    shape = np.shape(per_rank[0])
    level = [np.asarray(v, dtype=np.float64).ravel() for v in per_rank]
    while len(level) > 1:
        nxt = []
        for a, b in zip(level[0::2], level[1::2]):
            dot, aa, bb = float(a @ b), float(a @ a), float(b @ b)
            nxt.append((1 - dot / (2 * aa) if aa >= tiny else 1.0) * a
                       + (1 - dot / (2 * bb) if bb >= tiny else 1.0) * b)
        level = nxt
    return level[0].reshape(shape)
