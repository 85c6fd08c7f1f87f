"""Which layers sit on which stage, and the chunk order interleaved schedules run them in.

The train state keeps the stacked layers in model order, sharded over `stage` in contiguous
blocks (rule `layers: stage`): with virtual = 1, stage s holds layers s*L/p .. (s+1)*L/p - 1 and
runs them as they are, so checkpoints, evaluation and serving see the one model order under any
rule file. With virtual = v > 1 stage s runs chunks s, p + s, 2p + s, .. (each L/(p*v) layers):
the step permutes the stack into that chunk order on entry (`chunk_order`) and the gradients back
on exit, which moves (v-1)/v of each stage's layers between stages once per step each way; the
stored order, and so every checkpoint, stays the model's.
"""
from __future__ import annotations

import numpy as np

from meshlab.rules import RulesError


class LayoutError(RulesError):
    """The model's layers do not split over the rule file's stages (a rule-file/model mismatch)."""


def check_layers(n_layers: int, stages: int, virtual: int, where: str = "") -> int:
    """Layers per chunk; one clear error when the layers do not split evenly."""
    chunks = stages * virtual
    if n_layers % chunks:
        fits = [n for n in range(chunks, 4 * chunks + 1, chunks)]
        raise LayoutError(f"{where}pipeline over {stages} stages x {virtual} virtual stages needs model.n_layers "
                          f"divisible by {chunks} (every stage holds the same stacked shape in lockstep SPMD), but "
                          f"the model has {n_layers}; use n_layers in {fits[:3]}, or change the `stage` mesh size "
                          "or `strategies.pipeline.virtual`")
    return n_layers // chunks


def chunk_order(n_layers: int, stages: int, virtual: int) -> np.ndarray:
    """perm with stacked_for_the_step[i] = model_layer[perm[i]]: stage s's contiguous block holds its
    chunks c*p + s (c = 0..v-1) in order. The identity when virtual == 1."""
    lc = check_layers(n_layers, stages, virtual)
    return np.array([(c * stages + s) * lc + j for s in range(stages) for c in range(virtual) for j in range(lc)],
                    np.int32)


def stage_map(n_layers: int, stages: int, virtual: int) -> list[list[tuple[int, list[int]]]]:
    """Per stage: [(virtual stage index, [model layers])] in the order it runs them."""
    lc = check_layers(n_layers, stages, virtual)
    return [[(c * stages + s, list(range((c * stages + s) * lc, (c * stages + s + 1) * lc))) for c in range(virtual)]
            for s in range(stages)]
