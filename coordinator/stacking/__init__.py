"""Stacked training, the simulator's alone: clients of one architecture train as one model.

A device trains its one client; a simulation runs many in one process, and here the clients of
one task group run their algorithm's phase once, on models whose parameters carry a leading
client dimension. `Stacking` (groups.py) is a fleet's: it groups, halves stacks that run out of
memory and keeps stacks between rounds (kept.py); `run_stacked` (cohort.py) stacks the members'
state, runs the phase once and gives every member its row back; `CohortTrainer` (trainer.py)
draws each member's batches from its own generator and data. What an algorithm itself uses where
members differ is in `edge_sdk.algorithms.members`, all of stacking a device loads.
"""

from coordinator.stacking.cohort import run_stacked, stack_modules, unstack_module
from coordinator.stacking.groups import Stacking
from coordinator.stacking.kept import KeptStacks
from coordinator.stacking.trainer import CohortTrainer

__all__ = [
    "CohortTrainer",
    "KeptStacks",
    "Stacking",
    "run_stacked",
    "stack_modules",
    "unstack_module",
]
