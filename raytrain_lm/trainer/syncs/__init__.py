"""How often replica groups exchange what they learned, chosen by `parallel.sync`: a sync is
what one advance of the loop trains (worker.py), and the answers it gives the loop's other
questions (cadences, flags, ends, metrics). Each entry builds one from the loop's parts and
the group, with its own settings. A sync in rounds is `Rounds` with its outer update
(outer_update.py)."""

from __future__ import annotations

from raytrain_lm.trainer.syncs.diloco import DilocoUpdate
from raytrain_lm.trainer.syncs.every_step import EveryStep
from raytrain_lm.trainer.syncs.local_sgd import LocalSgdUpdate
from raytrain_lm.trainer.syncs.rounds import Rounds

SYNCS = {
    "every_step": EveryStep,
    "diloco": lambda parts, group: Rounds(
        parts, group, DilocoUpdate(parts.cfg.diloco, parts.trainee)
    ),
    "local_sgd": lambda parts, group: Rounds(
        parts, group, LocalSgdUpdate(parts.cfg.diloco, parts.trainee)
    ),
}
