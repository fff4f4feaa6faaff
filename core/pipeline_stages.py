"""How pipeline parallelism splits a model's decoder layers into stages: the engine's workers
(``gpu/distributed/pipeline.py``) and the twin's stages (``simulator/pipeline.py``) both read it."""

from __future__ import annotations


def stage_layer_counts(num_layers: int, pp: int,
                       partition: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """Layers per stage, first stage first: ``partition`` (``EngineArgs.layer_partition``),
    else vLLM's even split (``get_pp_indices``): ``num_layers // pp`` each, the remainder one
    more per stage counted back from the one before the last, since the last also computes the
    LM head. Raises ValueError naming what does not fit."""
    if pp < 1 or num_layers < pp:
        raise ValueError(f"num_hidden_layers ({num_layers}) must be at least pipeline parallel "
                         f"size ({pp}).")
    if partition is not None:
        if len(partition) != pp or sum(partition) != num_layers or min(partition) < 1:
            raise ValueError(f"pp_layer_partition {','.join(map(str, partition))} must give each "
                             f"of the {pp} stages at least one layer and sum to "
                             f"num_hidden_layers ({num_layers}).")
        return tuple(partition)
    sizes = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        sizes[-i % pp] += 1
    return tuple(sizes)
