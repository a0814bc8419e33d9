"""Loop detection: a degenerate answer spotted while it is streamed, by the rules in ``degeneration``."""

from expansion_dag.servers.loops.degeneration import LOOP_RULES, Loop, LoopDetector, LoopThresholds, find_loop, loop_cut

__all__ = ["LOOP_RULES", "Loop", "LoopDetector", "LoopThresholds", "find_loop", "loop_cut"]
