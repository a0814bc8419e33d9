"""What a shard's answers will yield, counted as they arrive, and the gate that stops a shard whose
answers the training set would throw away.

Each answer (a loop and an ended conversation included) is judged by the training set's own rules
(``training_set.AnswerJudge``, handed to the engine by the shell) the moment it is written: a row,
or the reason it will be left out. Once a shard has ``YieldGate.answers`` of them, a share of rows
under ``YieldGate.min_yield`` stops it, naming the most common reason and what to change. The
verdict is about the content, never the server: no server is benched or blamed, and every answer
stays in the store. A server's failure is no answer and is not judged here (the failure rate is).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from expansion_dag.training import FOLDED, LOOP_ROW, ROW

#: What to change, by the reason most answers are left out; ``{cap}`` is the configured cap.
ADVICE = {
    "reasoning_missing": "carry no reasoning while the chat template asks for thinking: launch SGLang with "
    "--reasoning-parser qwen3, or set chat_template_kwargs.enable_thinking: false",
    "reasoning_unexpected": "carry reasoning while the chat template turns thinking off: serve the model with a "
    "template that honours enable_thinking, or set chat_template_kwargs.enable_thinking: true",
    "think_tag_in_content": "leave <think> or </think> in the answer's content: launch SGLang with the model's own "
    "reasoning parser (--reasoning-parser qwen3 for Qwen3), which takes the whole think block out",
    "truncated": "were cut at max_output_tokens {cap}: raise it (or set drop_truncated: false to train on cut "
    "answers)",
    "empty": "came back with an empty content: check that the server's --reasoning-parser is the model's (one that "
    "does not match puts the whole answer in reasoning_content)",
    "degenerate": "looped and were stopped: raise repetition_penalty (e.g. 1.05) or change temperature and top_p",
    "unfinished": "ended unfinished (finish_reason neither stop nor length): read the server's log",
    "conversation_ended": "are conversations ended before their last turn (a turn cut, or the context full): raise "
    "max_output_tokens or the servers' --context-length",
}


@dataclass(frozen=True)
class YieldGate:
    """After the first ``answers`` answers of a shard, a share of rows under ``min_yield`` stops it
    (0 turns the gate off). ``max_output_tokens``: the cap, named in the advice."""

    min_yield: float
    answers: int
    max_output_tokens: int | None

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_yield <= 1.0:
            raise ValueError(f"min_yield must lie in [0, 1], got {self.min_yield}")
        if self.answers < 1:
            raise ValueError(f"answers (yield_gate_answers) must be at least 1, got {self.answers}")


@dataclass
class AnswerYield:
    """A shard run's answers by verdict: ``row`` or the reason the training set leaves them out."""

    verdicts: collections.Counter = field(default_factory=collections.Counter)
    #: ``pending`` until the gate's answers are in, then ``passed`` or ``stopped``.
    gate_state: str = "pending"

    def count(self, verdict: str) -> None:
        if verdict != FOLDED:  # an earlier turn: its conversation's row is judged at its last turn
            self.verdicts[verdict] += 1

    @property
    def judged(self) -> int:
        return sum(self.verdicts.values())

    @property
    def rows(self) -> int:
        """Answers that become rows, those cut before a loop included."""
        return self.verdicts[ROW] + self.verdicts[LOOP_ROW]

    @property
    def loop_rows(self) -> int:
        """Answers stopped as loops whose text before the loop becomes a row (``loop_prefix: keep``)."""
        return self.verdicts[LOOP_ROW]

    @property
    def share(self) -> float | None:
        return self.rows / self.judged if self.judged else None

    def summary(self) -> str:
        """``rows 96% (cut at a loop 2%); truncated 3%; degenerate 1%``: rows first, then the reasons,
        most common first."""
        if not self.judged:
            return "no answers yet"
        others = sorted(self.left_out().items(), key=lambda item: (-item[1], item[0]))
        rows = f"rows {self.rows / self.judged:.0%}" + (f" (cut at a loop {self.loop_rows / self.judged:.0%})" if self.loop_rows else "")
        return "; ".join([rows, *(f"{v} {n / self.judged:.0%}" for v, n in others)])

    def left_out(self) -> dict[str, int]:
        return {v: n for v, n in sorted(self.verdicts.items()) if v not in (ROW, LOOP_ROW)}

    def gate(self, gate: YieldGate) -> str | None:
        """The reason to stop the shard, once, when the gate's answers are in and too few are rows."""
        if self.gate_state != "pending" or self.judged < gate.answers:
            return None
        share = self.share or 0.0
        if share >= gate.min_yield:
            self.gate_state = "passed"
            return None
        self.gate_state = "stopped"
        reason, count = max(self.left_out().items(), key=lambda item: item[1])
        advice = ADVICE.get(reason, f"are left out as {reason}").format(cap=gate.max_output_tokens or "(max_tokens)")
        return (
            f"yield gate: {self.rows} of {self.judged} answers would become training rows ({share:.0%}, under "
            f"min_yield {gate.min_yield:.0%}): {count} of {self.judged} answers {advice}. A verdict on the answers, "
            "not on the server; every answer is kept in the store"
        )
