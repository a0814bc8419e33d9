"""A real trained model (issue 44): the project against a plain loop, its loop stops checked by the
engine itself, and what the loop detector costs the client.

CPU figures: SmolLM2-135M-Instruct (``.models/smollm2-135m-instruct``, built by CI) served by vLLM's
CPU build (``.venv-vllm``) on this machine's cores, never GPU figures. The prompts
(:func:`build_prompts`) are the issue's kinds, code, math word problems and explanations (and
lists, with ``--kinds``), from the bundled sample datasets' templates and lists and a few of this
script's own, seeded. Every request carries ``--seed``, so both runs write the same answer to a
prompt until the project stops it.

Phases (``--phases``, in this order):

- ``project``: the engine as the completions asset runs it (``generate_shard``, streamed in events
  of ``--stream-interval`` tokens, loops stopped, the training set's judge on each answer) on one
  server of ``--slots`` slots; ``plain``: a plain loop as hand-run scripts do it (``--slots``
  workers taking the prompts in order, plain requests, the fixed cap, nothing stopped), on the
  same prompts, settings and seed, on the same server. Each reports output tokens generated, the
  tokens of answers that become training rows (the training set's own judge), their ratio and
  the wall time.
- ``continue``: every answer the project stopped is continued by the engine for
  ``--continue-tokens`` more (the same messages, the partial answer as the final assistant message,
  ``continue_final_message``, without the seed: vLLM's CPU build fails seeded chunked prefills),
  and those that end on their own within ``--within`` tokens are counted: the stops a user could
  call false. ``--project-records`` runs it (and ``cap``) on an earlier project phase's records.
- ``cap``: the project's answers that ran to the cap, written to a file for a person to read
  (``cap-answers-*.md`` beside the result): the judgement of which are loops is theirs.
- ``detector``: the client CPU of the detector against the one at ``--baseline`` (git), on the
  same text: the answers of the fixture ``expansion_dag_tests/data/real_model_answers.jsonl.gz``
  fed as a stream would (events of 256 tokens, and of one token), until each stops or ends.

    .venv/bin/python bench/bench_real_model.py                                  # the issue's shape: ~1.5 h on 2 shared cores
    .venv/bin/python bench/bench_real_model.py --prompts 24 --max-tokens 1024   # a smoke run, ~10 min
    .venv/bin/python bench/bench_real_model.py --phases detector                # the detector's CPU alone, ~1 min
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from harness import ROOT, RESULTS_DIR, cpu_s, free_ports, header, process_cpu_s, stats, write_result

from expansion_dag.config import GenerationConfig, engine_config, sampling_settings, training_set_config
from expansion_dag.core import OK, ModeIdentities, ModeMix, count_prompt_tokens, load_tokenizer
from expansion_dag.generation import Server, WorkItem, generate_shard
from expansion_dag_tests.workloads.chat_sources import (
    CODE_PROMPTS_II,
    CODE_TASKS,
    CONTEXT_PROMPTS,
    GENERAL_PROMPTS,
    GSM_TEMPLATES,
    LANGUAGES,
    MATH_TEMPLATES,
    WEB_TEMPLATES,
)
from expansion_dag.servers import VLLM, LoopDetector, chat_request, parse_chat_completion
from expansion_dag.store import CompletionStore
from expansion_dag.training import DEFAULT_MAX_LENGTH, LOOP_ROW, ROW, AnswerJudge

MODEL_DIR = ROOT / ".models" / "smollm2-135m-instruct"
SERVED_NAME = "smollm2"
CONTEXT = 8192
FIXTURE = ROOT / "expansion_dag_tests" / "data" / "real_model_answers.jsonl.gz"

# ---------------------------------------------------------------------------------------------
# The prompts

EXTRA_CODE_TASKS = [
    "prints the multiplication table from 1 to 10", "checks whether a number is prime",
    "sorts a list of dictionaries by a given key", "computes the factorial of a number iteratively and recursively",
    "reads a JSON file and prints every key at every depth", "finds all pairs in a list that add up to a target",
    "generates the first n rows of Pascal's triangle", "counts the vowels in a string",
    "implements a stack with push, pop and peek", "converts a temperature table from Celsius to Fahrenheit",
    "simulates rolling two dice 1000 times and prints the frequency of each sum",
    "implements bubble sort and explains each pass", "computes the greatest common divisor of two numbers",
    "flattens a nested list", "checks whether two strings are anagrams", "implements a queue using two stacks",
]  # fmt: skip
CONCEPTS = [
    "photosynthesis", "inflation", "the greenhouse effect", "how a compiler works", "supply and demand",
    "the theory of evolution", "blockchain", "how vaccines work", "plate tectonics", "compound interest",
    "the Pythagorean theorem", "machine learning", "the water cycle", "DNA replication", "black holes",
    "object-oriented programming", "the French Revolution", "how the internet routes packets",
    "Newton's three laws of motion", "the stock market", "recursion", "entropy", "the immune system",
    "how a bill becomes law", "the difference between a virus and a bacterium", "big-O notation",
    "electric circuits", "the causes of World War I", "how GPS works", "the scientific method",
    "climate change", "neural networks", "the Krebs cycle", "public-key cryptography", "tides",
]  # fmt: skip
AUDIENCES = ["", " to a ten-year-old", " in simple terms", " step by step", " with an example", " in detail"]
LISTS = [
    "List the first {x} prime numbers.", "Write out the first {y} terms of the Fibonacci sequence.",
    "Make a table of the squares and cubes of the numbers from 1 to {y}.",
    "Compute 2 to the power n for n from 1 to {y}, one per line.",
    "Write a {lang} program that prints the multiplication table of {a} up to {a} x {y}.",
    "Write {n} unit tests in {lang} for a function that adds two numbers.",
    "List {y} countries and their capitals in a table.", "Give me {y} ideas for a birthday party, as a numbered list.",
    "Convert the temperatures from 0 to 100 degrees Celsius, in steps of 10, to Fahrenheit in a table.",
    "What is the sum of the first {x} odd numbers? Show every partial sum.",
    "Write the numbers from {z} to {z2} that are divisible by {a}.", "Expand $(x + {a})^{n}$ and list every coefficient.",
    "Find the pattern and continue the sequence for ten more terms: {a}, {a2}, {a3}, ...",
    "Write a SQL script that inserts {y} rows of sample data into a table of products.",
    "Solve the recurrence a(n) = a(n-1) + {b} with a(1) = {a} and list a(1) to a({y}).",
]  # fmt: skip
MATH_WORD = [
    "A shop sells pencils at {a} cents each. How much do {x} pencils cost, in dollars?",
    "A train travels {x} km in {b} hours. What is its average speed? How far does it go in {y} hours?",
    "Anna is {b} times as old as her brother, who is {y}. How old will Anna be in {a} years?",
    "A tank holds {z} litres and drains at {x} litres per minute. How long until it is empty?",
    "If {x} workers build a wall in {y} days, how long would {a} workers take?",
    "A rectangle has a perimeter of {z} cm and a length of {x} cm. What is its area?",
    "What is the sum of the first {x} positive integers? Show your work.",
    "A price of ${z} is raised by {p}% and then lowered by {p}%. What is the final price?",
    "How many numbers between 1 and {z} are divisible by {a} or {b}?",
    "Find the next three terms of the sequence {a}, {x}, ... if each term adds {b} to the previous one.",
]


#: The kinds of the issue's run (44): code, math word problems, explanations.
ISSUE_KINDS = ("code", "math", "explain")


def build_prompts(count: int, seed: int, kinds: tuple[str, ...] = ("list", *ISSUE_KINDS)) -> list[dict[str, str]]:
    """``count`` distinct prompts, as many of each of ``kinds`` (lists, code, math, explanations), shuffled."""
    rng = random.Random(seed)

    def numbers() -> dict[str, Any]:
        v = dict(a=rng.randint(2, 9), b=rng.randint(2, 6), x=rng.randint(3, 40), y=rng.randint(2, 30),
                 z=rng.randint(100, 999), p=rng.choice([10, 20, 25, 40]), v=rng.randint(5, 40), m=rng.randint(10, 90),
                 c=rng.choice([0.1, 0.01, 0.001]), n=rng.randint(3, 12), r=rng.choice([10, 47, 100]),
                 chem="glucose (C6H12O6)", lang=rng.choice(LANGUAGES))  # fmt: skip
        return v | dict(z2=v["z"] + 10 * v["a"] * v["b"], a2=2 * v["a"], a3=4 * v["a"])

    def one_of(*makers):
        return rng.choice(makers)()

    makers = {
        "list": lambda: rng.choice(LISTS).format(**numbers()),
        "code": lambda: one_of(
            lambda: f"Write a {rng.choice(LANGUAGES)} function that {rng.choice(CODE_TASKS + EXTRA_CODE_TASKS)}.",
            lambda: f"Write a {rng.choice(LANGUAGES)} program that {rng.choice(EXTRA_CODE_TASKS)}, with tests.",
            lambda: rng.choice(CODE_PROMPTS_II),
        ),
        "math": lambda: one_of(
            lambda: rng.choice(GSM_TEMPLATES + MATH_WORD).format(**numbers()),
            lambda: rng.choice(MATH_TEMPLATES).format(**numbers()),
            lambda: rng.choice(WEB_TEMPLATES)[1].format(**numbers()),
        ),
        "explain": lambda: one_of(
            lambda: f"Explain {rng.choice(CONCEPTS)}{rng.choice(AUDIENCES)}.",
            lambda: rng.choice(GENERAL_PROMPTS + CONTEXT_PROMPTS),
        ),
    }
    out: list[dict[str, str]] = []
    seen: set[str] = set()
    while len(out) < count:
        kind = kinds[len(out) % len(kinds)]
        text = makers[kind]()
        if text not in seen:
            seen.add(text)
            out.append({"id": f"p{len(out):04d}", "kind": kind, "prompt": text})
    rng.shuffle(out)
    return out


# ---------------------------------------------------------------------------------------------
# The server: vLLM's CPU build on the real model, started here so that the figures are this run's


@contextmanager
def vllm_server(model_dir: Path, slots: int, port: int, log: Path) -> Iterator[tuple[str, int]]:
    """(its URL, its process id) while it runs; stopped on the way out, its whole process group."""
    python = ROOT / ".venv-vllm" / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"{python} is missing: run `bash .ci/vllm-env` first")
    command = [
        str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
        "--served-model-name", SERVED_NAME, "--max-model-len", str(CONTEXT), "--max-num-seqs", str(slots),
        "--host", "127.0.0.1", "--port", str(port), "--kv-cache-memory-bytes", str(2**30), "--enforce-eager",
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    url = f"http://127.0.0.1:{port}"
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while not _healthy(url):
            if process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"vLLM did not start (exit {process.poll()}); see {log}")
            time.sleep(1)
        yield url, process.pid
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def group_cpu_s(pid: int) -> float:
    """CPU seconds of a process and its children now alive (the engine core is a child of vLLM's API server)."""
    total = 0.0
    for child in Path("/proc").iterdir():
        if child.name.isdigit():
            try:
                if os.getpgid(int(child.name)) == pid:
                    total += process_cpu_s(int(child.name))
            except (OSError, ValueError, IndexError):
                pass
    return total


# ---------------------------------------------------------------------------------------------
# The project and the plain loop


class Run:
    """What one phase needs: the prompts as the engine's work, the settings, the training set's judge."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.prompts = build_prompts(args.prompts, args.seed, tuple(args.kinds.split(",")))
        self.tokenizer = load_tokenizer(str(args.model_dir))
        self.sampling = sampling_settings(GenerationConfig(), temperature=args.temperature, top_p=args.top_p, top_k=-1, seed=args.seed,
                                         max_output_tokens=args.max_tokens)  # fmt: skip
        self.identities = ModeIdentities(ModeMix.single(self.sampling), SERVED_NAME, simulated=False)
        self.judge = AnswerJudge(self.tokenizer, training_set_config(GenerationConfig(), DEFAULT_MAX_LENGTH), self.identities)
        messages = [[{"role": "user", "content": p["prompt"]}] for p in self.prompts]
        counts = count_prompt_tokens(self.tokenizer, messages)
        self.items = [
            WorkItem(key=self.sampling.key(p["id"], SERVED_NAME), prompt_id=p["id"], source=p["kind"], messages=m,
                     prompt_tokens=n, max_tokens=min(args.max_tokens, CONTEXT - n - 16), expected_output_tokens=200)
            for p, m, n in zip(self.prompts, messages, counts)
        ]  # fmt: skip

    def tally(self, records: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
        """Tokens generated and kept as training rows (the judge's verdict on each record)."""
        generated = kept = 0
        verdicts: dict[str, int] = {}
        for record in records:
            tokens = record.get("completion_tokens") or record.get("streamed_tokens") or 0
            # A prompt asked again after a loop (--loop-retries): its first answer's tokens were spent too.
            tokens += (record.get("loop_retry") or {}).get("first_tokens", 0)
            verdict = self.judge(record)
            verdicts[verdict] = verdicts.get(verdict, 0) + 1
            generated += tokens
            # A stopped loop's row (loop_prefix: keep) holds only the tokens before its loop.
            kept += self.judge.kept_tokens(record) if verdict in (ROW, LOOP_ROW) else 0
        return {
            "answers": len(records), "verdicts": verdicts, "output_tokens_generated": generated,
            "output_tokens_kept": kept, "useful_token_share": round(kept / generated, 4) if generated else None,
            "loop_rows_share_of_rows": round(verdicts.get(LOOP_ROW, 0) / rows, 4) if (rows := verdicts.get(ROW, 0) + verdicts.get(LOOP_ROW, 0)) else None,
            "wall_s": round(wall_s, 1), "output_tokens_per_s": round(generated / wall_s, 1) if wall_s else None,
        }  # fmt: skip


def project_phase(run: Run, url: str, store_root: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    store = CompletionStore(store_root)
    config = engine_config(GenerationConfig(loop_retries=run.args.loop_retries), canary=False, progress_interval_s=60)
    server = Server(url, run.args.slots, dialect=VLLM, stream_interval=run.args.stream_interval)
    started, cpu = time.perf_counter(), cpu_s()
    with store.writer("real") as writer:
        report = generate_shard(run.items, [server], writer=writer, model=SERVED_NAME, sampling=run.sampling,
                                config=config, judge=run.judge)  # fmt: skip
    wall, cpu = time.perf_counter() - started, cpu_s() - cpu
    records = list(store.latest_records())
    result = run.tally(records, wall) | {
        "outcomes": dict(report.finish_reasons + report.failures_by_kind),
        "degenerate_by_rule": dict(report.degenerate_by_rule),
        "stopped_at_tokens": stats(stopped) if (stopped := [r["streamed_tokens"] for r in records if r.get("error") == "degenerate"]) else None,
        "client_cpu_ms_per_request": round(1000 * cpu / max(1, report.done), 2),
        # --loop-retries: prompts asked again with another seed after a stopped loop, and how many
        # of the second answers ended on their own.
        "loop_retried": dict(report.loop_retried),
    }
    return result, records


async def _plain(run: Run, url: str) -> list[dict[str, Any]]:
    """Workers as many as the slots, each taking the next prompt in order: the fixed cap, nothing stopped."""
    queue = list(reversed(run.items))
    records: list[dict[str, Any]] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(7200, connect=10)) as client:

        async def worker() -> None:
            while queue:
                item = queue.pop()
                request = chat_request(SERVED_NAME, item.messages, run.args.max_tokens, run.sampling)
                response = await client.post(f"{url}/v1/chat/completions", json=request.body())
                response.raise_for_status()
                answer = parse_chat_completion(response.json(), VLLM)
                records.append({
                    "key": item.key, "status": OK, "prompt_id": item.prompt_id, "source": item.source, "mode": "default",
                    "messages": list(item.messages), "content": answer.content, "reasoning_content": answer.reasoning,
                    "finish_reason": answer.finish_reason, "completion_tokens": answer.completion_tokens,
                })  # fmt: skip

        await asyncio.gather(*(worker() for _ in range(run.args.slots)))
    return records


def plain_phase(run: Run, url: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    started = time.perf_counter()
    records = asyncio.run(_plain(run, url))
    return run.tally(records, time.perf_counter() - started), records


# ---------------------------------------------------------------------------------------------
# The stops continued, the answers at the cap


async def _continue(run: Run, url: str, stopped: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each stopped answer asked to go on: the same messages, its text the final assistant message."""
    queue = list(stopped)
    # A stopped single-turn answer's record keeps no messages: the run's own prompts have them.
    messages_of = {item.prompt_id: item.messages for item in run.items}
    out: list[dict[str, Any]] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(7200, connect=10)) as client:

        async def worker() -> None:
            while queue:
                record = queue.pop()
                messages = [*messages_of[record["prompt_id"]], {"role": "assistant", "content": record["content"]}]
                request = chat_request(SERVED_NAME, messages, run.args.continue_tokens, run.sampling)
                # No seed: vLLM 0.32's CPU build fails a seeded request whose prompt is prefilled in
                # chunks ("CPU Generator does not use offset"), and the engine with it.
                body = {k: v for k, v in request.body().items() if k != "seed"}
                body |= {"continue_final_message": True, "add_generation_prompt": False}
                response = await client.post(f"{url}/v1/chat/completions", json=body)
                response.raise_for_status()
                answer = parse_chat_completion(response.json(), VLLM)
                out.append({
                    "prompt_id": record["prompt_id"], "rule": record.get("loop_rule"),
                    "stopped_at_tokens": record.get("streamed_tokens"), "finish_reason": answer.finish_reason,
                    "more_tokens": answer.completion_tokens, "continuation_tail": answer.content[-300:],
                })  # fmt: skip

        await asyncio.gather(*(worker() for _ in range(run.args.slots)))
    return sorted(out, key=lambda r: r["prompt_id"])


def continue_phase(run: Run, url: str, records: list[dict[str, Any]]) -> dict[str, Any]:
    stopped = [r for r in records if r.get("error") == "degenerate"]
    continued = asyncio.run(_continue(run, url, stopped))
    ended = [c for c in continued if c["finish_reason"] == "stop"]
    within = run.args.within
    return {
        "stopped": len(stopped), "continue_tokens": run.args.continue_tokens,
        "ended_on_their_own": len(ended), f"ended_within_{within}_tokens": sum(c["more_tokens"] <= within for c in ended),
        "answers": continued,
    }  # fmt: skip


def cap_answers(records: list[dict[str, Any]], out: Path) -> dict[str, Any]:
    """The answers that ran to the cap, their ends written for a person to read."""
    capped = [r for r in records if r.get("status") == OK and r.get("finish_reason") == "length"]
    lines = [f"# Answers that ran to the cap ({len(capped)})\n"]
    for r in capped:
        lines += [f"## {r['prompt_id']} ({r['source']}, {r['completion_tokens']} tokens)\n",
                  f"Prompt: {r['messages'][-1]['content'][:200]}\n", "```", r["content"][-1200:], "```\n"]  # fmt: skip
    out.write_text("\n".join(lines))
    return {"answers_at_cap": len(capped), "review_file": str(out.relative_to(ROOT)), "prompt_ids": [r["prompt_id"] for r in capped]}


# ---------------------------------------------------------------------------------------------
# The detector's CPU, against the baseline's on the same text


def baseline_detector(revision: str):
    """The baseline's ``LoopDetector`` class, read from git (its module had no sibling imports)."""
    source = subprocess.run(["git", "show", f"{revision}:expansion_dag/servers/degeneration.py"], cwd=ROOT,
                            check=True, capture_output=True, text=True).stdout  # fmt: skip
    spec = importlib.util.spec_from_loader("baseline_degeneration", loader=None)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    exec(compile(source, f"{revision}:degeneration.py", "exec"), module.__dict__)
    return module.LoopDetector, module.LoopThresholds


def stream_events(tokenizer, text: str, interval: int) -> list[str]:
    """``text`` cut as a stream of ``interval`` tokens an event cuts it: the first token alone, then ``interval`` each."""
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    ends = [offsets[min(i, len(offsets)) - 1][1] for i in [1, *range(1 + interval, len(offsets), interval)]] + [len(text)]
    return [text[a:b] for a, b in zip([0, *ends], ends) if b > a]


def detector_phase(args: argparse.Namespace) -> dict[str, Any]:
    with gzip.open(FIXTURE, "rt", encoding="utf-8") as f:
        texts = [json.loads(line)["content"] for line in f]
    tokenizer = load_tokenizer(str(args.model_dir))
    old_detector, old_thresholds = baseline_detector(args.baseline)

    now = engine_config(GenerationConfig()).loop  # the engine's, as a run configures it
    result: dict[str, Any] = {"answers": len(texts), "chars": sum(map(len, texts))}
    for interval in (256, 1):
        streams = [stream_events(tokenizer, t, interval) for t in texts]
        for name, make in (("baseline", lambda: old_detector(old_thresholds())), ("now", lambda: LoopDetector(now))):
            runs, fed = [], 0
            for _ in range(args.repeat):
                fed, started = 0, time.process_time()
                for events in streams:
                    detector = make()
                    for delta in events:
                        fed += len(delta)
                        if detector.feed(delta) is not None:
                            break
                runs.append(time.process_time() - started)
            best = min(runs)
            result[f"{name}, events of {interval} tokens"] = {
                "cpu_ms_per_answer": round(1000 * best / len(texts), 3), "us_per_1000_chars_fed": round(1e6 * best / fed * 1000, 1),
                "chars_fed": fed,
            }  # fmt: skip
    return result


# ---------------------------------------------------------------------------------------------


PHASES = ("project", "plain", "continue", "cap", "detector")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated, of {', '.join(PHASES)}")
    parser.add_argument("--model-dir", type=Path, default=MODEL_DIR)
    parser.add_argument("--prompts", type=int, default=280)
    parser.add_argument("--seed", type=int, default=44)
    parser.add_argument("--kinds", default=",".join(ISSUE_KINDS), help="of list, code, math, explain (default: the issue's)")
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--stream-interval", type=int, default=256, help="tokens per streamed event (the fleet's default)")
    parser.add_argument("--loop-retries", type=int, default=0, help="project phase: generation.loop_retries (0: a stop is final)")
    parser.add_argument("--continue-tokens", type=int, default=768)
    parser.add_argument("--within", type=int, default=256, help="a stopped answer ending within this many more tokens is a false stop")
    parser.add_argument("--project-records", type=Path,
                        help="continue and cap phases: the records of an earlier project phase (its .jsonl.gz)")
    parser.add_argument("--url", help="an OpenAI server already serving the model as 'smollm2' (default: start one)")
    parser.add_argument("--port", type=int, default=18500)
    parser.add_argument("--baseline", default="ca92c16", help="git revision of the detector compared against")
    parser.add_argument("--repeat", type=int, default=5, help="detector phase: runs, the best kept")
    args = parser.parse_args()
    phases = args.phases.split(",")
    if unknown := set(phases) - set(PHASES):
        parser.error(f"unknown phases {sorted(unknown)}")
    document = header("real_model", "transformers", simulator=False) | {
        "label": "CPU figures: a real model on vLLM's CPU build, not GPU figures",
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    }
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"real_model-{stamp}.json"
    if "detector" in phases:
        document["detector"] = detector_phase(args)
        write_result("real_model", document, path=path)
    served = [p for p in phases if p != "detector"]
    if served:
        with tempfile.TemporaryDirectory(prefix="bench-real-") as scratch, _server(args) as (url, pid):
            run = Run(args)
            document["server"] = {"url": url, "started_here": pid is not None}
            records: list[dict[str, Any]] = []
            if args.project_records:
                with gzip.open(args.project_records, "rt", encoding="utf-8") as f:
                    records = [json.loads(line) for line in f]
            for phase in served:
                before = group_cpu_s(pid) if pid else None
                if phase == "project":
                    document["project"], records = project_phase(run, url, Path(scratch) / "store")
                elif phase == "plain":
                    document["plain"], plain_records = plain_phase(run, url)
                    _save(plain_records, RESULTS_DIR / f"real_model-plain-{stamp}.jsonl.gz")
                elif phase == "continue":
                    document["continue"] = continue_phase(run, url, records)
                else:
                    document["cap"] = cap_answers(records, RESULTS_DIR / f"cap-answers-{stamp}.md")
                if before is not None:
                    document.setdefault("server_cpu_s", {})[phase] = round(group_cpu_s(pid) - before, 1)
                if phase == "project":
                    _save(records, RESULTS_DIR / f"real_model-project-{stamp}.jsonl.gz")
                write_result("real_model", document, path=path)
                print(f"{phase}: done, {path}", file=sys.stderr, flush=True)
    if "project" in document and "plain" in document:
        document["useful_share_project_over_plain"] = round(
            document["project"]["useful_token_share"] / document["plain"]["useful_token_share"], 3
        )
        write_result("real_model", document, path=path)
    print(json.dumps(document, indent=2))


@contextmanager
def _server(args: argparse.Namespace) -> Iterator[tuple[str, int | None]]:
    if args.url:
        yield args.url.rstrip("/"), None
        return
    port = free_ports(1, args.port)
    log = RESULTS_DIR / f"vllm-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.log"
    with vllm_server(args.model_dir, args.slots, port, log) as (url, pid):
        yield url, pid


def _save(records: list[dict[str, Any]], path: Path) -> None:
    """The phase's records, for a person (and the fixture's maker) to read again."""
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps({k: v for k, v in record.items() if k not in ("prompt_ids", "output_ids")}) + "\n")


if __name__ == "__main__":
    main()
