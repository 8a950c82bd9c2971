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

from pagedbench.reference.errors import PagedValueError
from pagedbench.reference.workload import DEFAULT_MAX_CONTEXT, Request

from pagedbench.harness.capacity.traces import generate_trace

#: Few-shot tasks in a few-shot trace.
FEW_SHOT_TASKS = 4


def _log_uniform(rng: random.Random, high: int) -> int:
    return max(1, min(high, round(math.exp(rng.uniform(0.0, math.log(max(1, high)))))))


def _check(num_requests: int, max_context: int, least: int) -> None:
    if num_requests < 1:
        raise PagedValueError("num_requests", num_requests, ">= 1")
    if max_context < least:
        raise PagedValueError("max_context", max_context, f">= {least} for this trace kind")


def _sessions(num_requests: int, rng: random.Random, turns: tuple[int, int],
              first: Callable[[], Request], next_turn: Callable[[Request], Request | None]
              ) -> list[Request]:
    """Sessions of ``turns`` (inclusive range) requests, the first drawn by ``first``, each
    next by ``next_turn(previous)`` (None ends the session), listed turn by turn, until
    ``num_requests`` requests."""
    sessions: list[list[Request]] = []
    total = 0
    while total < num_requests:
        length = rng.randint(*turns)
        session = [first()]
        while len(session) < min(length, num_requests - total):
            nxt = next_turn(session[-1])
            if nxt is None:
                break
            session.append(nxt)
        sessions.append(session)
        total += len(session)
    trace: list[Request] = []
    index_of: dict[tuple[int, int], int] = {}
    for turn in range(max(len(s) for s in sessions)):
        for s, session in enumerate(sessions):
            if turn < len(session):
                req = session[turn]
                if turn:
                    req = Request(req.prompt_len, req.output_len, parent=index_of[s, turn - 1])
                index_of[s, turn] = len(trace)
                trace.append(req)
    return trace


def generate_multi_turn_trace(num_requests: int, max_context: int = DEFAULT_MAX_CONTEXT,
                              seed: int = 0) -> list[Request]:
    """Chat sessions (module docstring), ``num_requests`` requests.

    Raises
    ------
    PagedValueError
        If ``num_requests`` < 1 or ``max_context`` < 64.
    """
    _check(num_requests, max_context, 64)
    rng = random.Random(seed)
    system, message, reply = max_context // 16, max_context // 16, max_context // 8

    def first() -> Request:
        return Request(system + _log_uniform(rng, message), _log_uniform(rng, reply),
                       prefix_id="chat", prefix_len=system)

    def next_turn(previous: Request) -> Request | None:
        prompt = previous.total_len + _log_uniform(rng, message)
        output = _log_uniform(rng, reply)
        return None if prompt + output > max_context else Request(prompt, output)

    return _sessions(num_requests, rng, (2, 8), first, next_turn)


def generate_agent_trace(num_requests: int, max_context: int = DEFAULT_MAX_CONTEXT,
                         seed: int = 0) -> list[Request]:
    """Tool-calling agent loops (module docstring), ``num_requests`` requests.

    Raises
    ------
    PagedValueError
        If ``num_requests`` < 1 or ``max_context`` < 64.
    """
    _check(num_requests, max_context, 64)
    rng = random.Random(seed)
    tools, task, action, observation = (max_context // 4, max_context // 32, max_context // 32,
                                        max_context // 16)

    def first() -> Request:
        return Request(tools + _log_uniform(rng, task), _log_uniform(rng, action),
                       prefix_id="tools", prefix_len=tools)

    def next_turn(previous: Request) -> Request | None:
        prompt = previous.total_len + _log_uniform(rng, observation)
        output = _log_uniform(rng, action)
        return None if prompt + output > max_context else Request(prompt, output)

    return _sessions(num_requests, rng, (3, 12), first, next_turn)


def generate_few_shot_trace(num_requests: int, max_context: int = DEFAULT_MAX_CONTEXT,
                            seed: int = 0) -> list[Request]:
    """Few-shot batches (module docstring), ``num_requests`` requests.

    Raises
    ------
    PagedValueError
        If ``num_requests`` < 1 or ``max_context`` < 64.
    """
    _check(num_requests, max_context, 64)
    rng = random.Random(seed)
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
    "multi-turn": generate_multi_turn_trace,
    "agent": generate_agent_trace,
    "few-shot": generate_few_shot_trace,
}


__all__ = ["FEW_SHOT_TASKS", "TRACE_KINDS", "generate_agent_trace", "generate_few_shot_trace",
           "generate_multi_turn_trace"]
