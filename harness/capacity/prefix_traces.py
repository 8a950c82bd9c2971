"""Request traces whose prompts share prefixes: multi-turn chat, agent loops, few-shot
batches; :data:`TRACE_KINDS` names them (with ``mixed``, :func:`~.traces.generate_trace`'s
independent requests) for ``pagedbench simulate --trace-kind`` and ``pagedbench tune``.

Every length is drawn log-uniform in ``[1, high]`` (``round(exp(U(0, ln high)))``), from
one ``random.Random(seed)``; the highs are fractions of ``max_context`` (2048 by default)
so that the same kinds scale with the context. All first requests queue at step 0; a
later turn or step (``parent``) is released the step after its parent finishes (the
user, or the tool, answers at once).

- **multi-turn** (chat): sessions of 2 to 8 turns. Turn 1 is a shared 1/16-context system
  prompt (``prefix_id`` ``chat``) and a message of up to 1/16 context; each next turn's
  prompt is the whole conversation so far (the parent's prompt and reply) and a new
  message of up to 1/16 context; replies up to 1/8 context. A session ends early when its
  next turn would not fit ``max_context``.
- **agent** (tool-calling loops): tasks of 3 to 12 steps over one shared tool and system
  prompt of 1/4 context (``prefix_id`` ``tools``), a task of up to 1/32 context; each step
  emits an action of up to 1/32 context and the next step's prompt appends the tool's
  observation, up to 1/16 context (the scratchpad grows).
- **few-shot** (batched evaluation): 4 tasks, each a prompt of instructions and examples
  of 1/4 to 3/8 context (drawn once per task; ``prefix_id`` ``task<t>``); every request is
  one task's prompt and a question of up to 1/32 context, answered in up to 1/32 context.

Requests are listed turn by turn (every session's first turn, then every second one,
...), so that each parent comes before its children.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from pagedbench.reference.errors import PagedValueError
from pagedbench.reference.workload import DEFAULT_MAX_CONTEXT, Request

from pagedbench.harness.capacity.traces import generate_trace

#: Few-shot tasks in a few-shot trace.
FEW_SHOT_TASKS = 4
#: The least ``max_context`` of every kind here.
MIN_MAX_CONTEXT = 64


def _log_uniform(rng: random.Random, high: int) -> int:
    return max(1, min(high, round(math.exp(rng.uniform(0.0, math.log(max(1, high)))))))


def _rng(num_requests: int, max_context: int, seed: int) -> random.Random:
    """The trace's one ``random.Random(seed)``, once the sizes are checked."""
    if num_requests < 1:
        raise PagedValueError("num_requests", num_requests, ">= 1")
    if max_context < MIN_MAX_CONTEXT:
        raise PagedValueError("max_context", max_context,
                              f">= {MIN_MAX_CONTEXT} for this trace kind")
    return random.Random(seed)


@dataclass(frozen=True)
class Sessions:
    """A trace kind of sessions over one shared prefix (module docstring), a callable
    ``(num_requests, max_context, seed) -> trace``.

    Attributes
    ----------
    turns : tuple[int, int]
        Requests per session, an inclusive range.
    prefix_id : str
        The shared prefix, ``max_context // prefix`` tokens.
    prefix, opening, addition, reply : int
        Divisors of ``max_context``: the first prompt is the prefix and up to ``max_context
        // opening`` tokens; each next one is the session so far (the previous prompt and
        reply) and up to ``max_context // addition``; replies up to ``max_context // reply``.
    """

    turns: tuple[int, int]
    prefix_id: str
    prefix: int
    opening: int
    addition: int
    reply: int

    def __call__(self, num_requests: int, max_context: int = DEFAULT_MAX_CONTEXT,
                 seed: int = 0) -> list[Request]:
        """``num_requests`` requests listed turn by turn; a session ends early when its
        next turn would not fit ``max_context``.

        Raises
        ------
        PagedValueError
            If ``num_requests`` < 1 or ``max_context`` < 64.
        """
        rng = _rng(num_requests, max_context, seed)
        prefix_len = max_context // self.prefix
        opening, addition = max_context // self.opening, max_context // self.addition
        reply = max_context // self.reply
        sessions: list[list[Request]] = []
        total = 0
        while total < num_requests:
            length = min(rng.randint(*self.turns), num_requests - total)
            session = [Request(prefix_len + _log_uniform(rng, opening), _log_uniform(rng, reply),
                               prefix_id=self.prefix_id, prefix_len=prefix_len)]
            while len(session) < length:
                prompt = session[-1].total_len + _log_uniform(rng, addition)
                output = _log_uniform(rng, reply)
                if prompt + output > max_context:
                    break
                session.append(Request(prompt, output))
            sessions.append(session)
            total += len(session)
        trace: list[Request] = []
        index_of: dict[tuple[int, int], int] = {}
        for turn in range(max(len(s) for s in sessions)):
            for s, session in enumerate(sessions):
                if turn < len(session):
                    req = session[turn]
                    if turn:
                        req = Request(req.prompt_len, req.output_len,
                                      parent=index_of[s, turn - 1])
                    index_of[s, turn] = len(trace)
                    trace.append(req)
        return trace


#: Chat sessions (module docstring).
MULTI_TURN = Sessions(turns=(2, 8), prefix_id="chat", prefix=16, opening=16, addition=16,
                      reply=8)
#: Tool-calling agent loops (module docstring).
AGENT = Sessions(turns=(3, 12), prefix_id="tools", prefix=4, opening=32, addition=16,
                 reply=32)


def generate_few_shot_trace(num_requests: int, max_context: int = DEFAULT_MAX_CONTEXT,
                            seed: int = 0) -> list[Request]:
    """Few-shot batches (module docstring), ``num_requests`` requests.

    Raises
    ------
    PagedValueError
        If ``num_requests`` < 1 or ``max_context`` < 64.
    """
    rng = _rng(num_requests, max_context, seed)
    prompts = [rng.randint(max_context // 4, 3 * max_context // 8)
               for _ in range(FEW_SHOT_TASKS)]
    question = answer = max_context // 32
    trace = []
    for _ in range(num_requests):
        task = rng.randrange(FEW_SHOT_TASKS)
        trace.append(Request(prompts[task] + _log_uniform(rng, question),
                             _log_uniform(rng, answer), prefix_id=f"task{task}",
                             prefix_len=prompts[task]))
    return trace


#: Trace kinds by name: ``(num_requests, max_context, seed) -> trace``.
TRACE_KINDS: dict[str, Callable[[int, int, int], list[Request]]] = {
    "mixed": lambda n, max_context, seed: generate_trace(n, max_context, seed),
    "multi-turn": MULTI_TURN,
    "agent": AGENT,
    "few-shot": generate_few_shot_trace,
}


__all__ = ["AGENT", "FEW_SHOT_TASKS", "MULTI_TURN", "TRACE_KINDS", "Sessions",
           "generate_few_shot_trace"]
