"""Replica folding's copies: found from the Strategy by ``strategies.symmetry`` (the lowering
of copy 0 needs them, and strategies/ imports nothing of the simulator); re-exported here."""

from strategies.symmetry import Copies, CrossCopy, copies_of, find_copies

__all__ = ["Copies", "CrossCopy", "copies_of", "find_copies"]
