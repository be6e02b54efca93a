"""Stacked training, the simulator's alone: clients of one architecture train as one model.

A device trains its one client; a simulation runs many in one process, and here the clients of
one task group run their algorithm's phase once, on models whose parameters carry a leading
client dimension. One job a file:
- groups.py: `Stacking`, a fleet's: groups tasks, halves stacks that run out of memory,
  checks a plugin's stacked phases once against one client alone;
- pays.py: whether a group's stack pays on its device (`cohort = "auto"`), as measured;
- kept.py: the stacks a fleet keeps between rounds (CUDA graphs);
- cohort.py: `run_stacked`, one phase of an algorithm run once for all members;
- state.py: the members' state stacked and given back;
- modules.py: stacked models (`stack_modules`), run as one batched program;
- trainer.py: `CohortTrainer`, each member's batches from its own generator and data;
- stacked_data.py: `StackedData`, the members' data side by side, packed once while it lives;
- frozen.py: the rows of the members that sit a step out, put back after the update.

What an algorithm itself uses where members differ is in `edge_sdk.algorithms.members`, all of
stacking a device loads.
"""

from coordinator.stacking.cohort import run_stacked
from coordinator.stacking.groups import Stacking
from coordinator.stacking.kept import KeptStacks
from coordinator.stacking.modules import stack_modules, unstack_module
from coordinator.stacking.trainer import CohortTrainer

__all__ = [
    "CohortTrainer",
    "KeptStacks",
    "Stacking",
    "run_stacked",
    "stack_modules",
    "unstack_module",
]
