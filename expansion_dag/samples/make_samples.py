"""Writes the bundled sample datasets: small files in the real layouts and schemas of the six sources.

    python expansion_dag/samples/make_samples.py

All text is written here (no real dataset rows). Besides ordinary prompts of many lengths, the
samples hold on purpose: rows each quarantine reason catches, non-English Infinity-Instruct rows
for the ``langdetect`` filter, duplicates within and across sources, one prompt of more than
9,000 tokens (set aside by the token budget at an 8,192 context) and one of more than 200,000
characters (quarantined as ``too_long_chars``). The output is deterministic: a fixed seed, sorted
keys, and no timestamps.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

HERE = Path(__file__).parent
SEED = 20240625
HERMES_CONFIGS = (
    "func_calling_singleturn",
    "func_calling",
    "glaive_func_calling",
    "json_mode_agentic",
    "json_mode_singleturn",
)
AGENT_SPLITS = ("os", "db", "alfworld", "webshop", "kg", "mind2web")

# A lone UTF-16 surrogate written as if it were UTF-8 ("WTF-8"): what a careless converter leaves
# behind when it splits an emoji's surrogate pair. Parquet stores the bytes; they are not UTF-8.
LONE_SURROGATE = b"\xed\xa0\xbd"

# Shared between sources on purpose, so deduplication has cross-source work to do.
PALINDROME = (
    "Write a Python function `is_palindrome(text)` that returns True when the text reads the same "
    "forwards and backwards, ignoring case, spaces and punctuation. Include a few doctest examples."
)
TRAIN_PROBLEM = (
    "A train leaves the station at 9:40 and travels 168 km at an average speed of 72 km/h. "
    "At what time does it arrive?"
)


def main(out_dir: Path = HERE) -> None:
    rng = random.Random(SEED)
    for write in (
        write_infinity_instruct,
        write_webinstructsub,
        write_codefeedback,
        write_metamathqa,
        write_hermes,
        write_agentinstruct,
    ):
        write(rng, out_dir)


# --- file writers ---------------------------------------------------------------------------


def text_array(values: list[str | bytes | None]) -> pa.Array:
    """A string array that may hold invalid UTF-8 bytes, which pyarrow would refuse to build."""
    raw = [v.encode() if isinstance(v, str) else v for v in values]
    return pa.array(raw, pa.binary()).view(pa.string())


def conversations_array(rows: list[list[dict[str, Any]] | None], *, with_loss: bool = False) -> pa.Array:
    offsets, roles, values, losses, valid = [0], [], [], [], []
    for turns in rows:
        valid.append(turns is not None)
        for turn in turns or []:
            roles.append(turn["from"])
            values.append(turn["value"])
            losses.append(turn["from"] == "gpt")
        offsets.append(len(roles))
    children = [pa.array(roles, pa.string())]
    names = ["from"]
    if with_loss:
        children.append(pa.array(losses, pa.bool_()))
        names.append("loss")
    children.append(text_array(values))
    names.append("value")
    structs = pa.StructArray.from_arrays(children, names=names)
    mask = pa.array([not v for v in valid])
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), structs, mask=mask)


def write_parquet(table: pa.Table, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, compression="zstd", compression_level=19)


def write_json_array(records: list[dict[str, Any]], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = ",\n".join(json.dumps(r, ensure_ascii=False) for r in records)
    path.write_text(f"[\n{lines}\n]\n", encoding="utf-8")


def write_jsonl(records: list[dict[str, Any]], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")


def human(value: str | bytes | None) -> dict[str, Any]:
    return {"from": "human", "value": value}


def gpt(value: str) -> dict[str, Any]:
    return {"from": "gpt", "value": value}


# --- BAAI/Infinity-Instruct, config 0625 ------------------------------------------------------

GENERAL_PROMPTS = [
    "Explain the difference between TCP and UDP, and give one application where each is the better choice.",
    "Write a haiku about the first snow in a city.",
    "Summarize the causes of the French Revolution in five bullet points.",
    "My sourdough starter smells like nail polish remover. What does that mean and how do I fix it?",
    "Give me three arguments for and three against a four-day working week, then a one-sentence verdict.",
    "Translate into formal English: 'hey, can u send me the report by tmrw? thx'",
    "What is the difference between weather and climate? Answer for a ten-year-old.",
    "Draft a polite email to a landlord asking for the broken heating to be repaired before the weekend.",
    "Compare the Roman and the Han empires at their height: population, government and trade.",
    "Why does ice float on water? Explain the role of hydrogen bonds.",
    "List five common logical fallacies with a short everyday example of each.",
    "Write a short story, under 200 words, about a lighthouse keeper who finds a message in a bottle.",
    "How do vaccines train the immune system? Keep it under 150 words.",
    "Suggest a one-week beginner running plan for someone who currently does not exercise.",
    "What are the main differences between a Roth IRA and a traditional IRA?",
    "Rewrite this sentence in the passive voice: 'The committee approved the new budget on Monday.'",
    "Explain what a hash table is and why lookups are usually constant time.",
    "Propose a name and a tagline for a bakery that only sells gluten-free bread.",
    "Describe the water cycle as a sequence of numbered steps.",
    "What questions should I ask at the end of a job interview for a data analyst position?",
    "Explain the Monty Hall problem and why switching doors wins two times out of three.",
    "Create a packing list for a three-day hiking trip in autumn in the mountains.",
    "What is opportunity cost? Give an example from a student's daily life.",
    "Write a limerick about a cat who learned to use a computer.",
    "Outline a 10-minute presentation on renewable energy for a high school class.",
    "Explain recursion to someone who has never programmed, using a non-computer analogy.",
    "What were the main consequences of the invention of the printing press in Europe?",
    "I have eggs, spinach, feta and half an onion. Suggest a dinner and give the steps.",
    "Explain the difference between 'affect' and 'effect' with two example sentences each.",
    "Give a brief overview of how a bill becomes a law in the United States.",
]

CONTEXT_PROMPTS = [
    (
        "Read the following product review and classify its sentiment as positive, negative or "
        "mixed. Then list the specific features the reviewer mentions.\n\n"
        "Review: I bought this kettle three weeks ago. It boils a full litre in under three "
        "minutes, which is great, and the handle stays cool. However, the lid hinge already feels "
        "loose and the blue light is so bright that it lights up the whole kitchen at night. The "
        "price was fair, but I expected the build quality to be better for a brand this well known."
    ),
    (
        "You are a careful editor. Improve the clarity and flow of the paragraph below without "
        "changing its meaning, then explain your three most important changes.\n\n"
        "The meeting which was held on Tuesday and which was attended by most of the team members "
        "except for those who were on holiday, decided that the project deadline, which had "
        "originally been set for March, would be moved, due to the fact that the supplier had "
        "informed us that there would be delays in the delivery of the components that are needed."
    ),
    (
        "Here are my notes from a lecture on photosynthesis. Turn them into a structured study "
        "guide with headings, key terms in bold, and three self-test questions at the end.\n\n"
        "- light reactions in thylakoid membranes, make ATP + NADPH, split water, O2 released\n"
        "- Calvin cycle in stroma, uses ATP/NADPH, fixes CO2 with RuBisCO\n"
        "- C4 and CAM plants: adaptations for hot/dry, separate CO2 capture in space or time\n"
        "- limiting factors: light intensity, CO2 concentration, temperature\n"
        "- chlorophyll a/b absorb red and blue, reflect green"
    ),
    (
        "The table below shows monthly sales for a small shop. Describe the trend, point out any "
        "anomaly, and suggest one possible explanation for it.\n\n"
        "Month | Sales (EUR)\nJan | 12,400\nFeb | 11,900\nMar | 13,100\nApr | 13,800\n"
        "May | 6,200\nJun | 14,500\nJul | 15,200\nAug | 14,900"
    ),
    (
        "Act as a travel planner. I will be in Lisbon for four days in October with my partner. "
        "We like food markets, architecture and short walks, but we do not enjoy museums much and "
        "one of us has a bad knee, so steep climbs should be limited. Plan each day with a morning, "
        "afternoon and evening suggestion and include one day trip outside the city."
    ),
]

CODE_PROMPTS_II = [
    PALINDROME,
    (
        "Write a SQL query that returns the five customers with the highest total order value in 2023 "
        "from tables customers(id, name) and orders(id, customer_id, total, created_at)."
    ),
    "In JavaScript, what is the difference between `==` and `===`? Show two surprising comparisons.",
    "Write a Bash one-liner that counts the lines of all .py files in a directory tree.",
    (
        "Explain what this Python code prints and why:\n\n```python\ndef f(x, acc=[]):\n    acc.append(x)\n"
        "    return acc\n\nprint(f(1))\nprint(f(2))\n```"
    ),
    "Implement binary search in Rust for a sorted slice of i32 and return Option<usize>.",
]

MULTI_TURN = [
    [
        human("What is the capital of Australia?"),
        gpt("The capital of Australia is Canberra."),
        human("Why was it chosen over Sydney and Melbourne?"),
        gpt("It was a compromise between the two rival cities..."),
    ],
    [
        {"from": "system", "value": "You are a concise assistant who answers in at most three sentences."},
        human("How do noise-cancelling headphones work?"),
        gpt("They use microphones to pick up ambient sound and play an inverted wave..."),
        human("Do they work equally well on all frequencies?"),
        gpt("No. They are most effective on steady low-frequency sounds..."),
    ],
    [
        human("Give me a regular expression that matches a UK postcode."),
        gpt("A common pattern is ^[A-Z]{1,2}\\d[A-Z\\d]? ?\\d[A-Z]{2}$ ..."),
        human("Now make it case-insensitive and explain each part."),
        gpt("Add the i flag..."),
    ],
]

NON_ENGLISH = [
    ("zh-cn", "请用三句话解释什么是机器学习。"),
    ("zh-cn", "写一首关于秋天的短诗。"),
    ("ko", "서울에서 가볼 만한 곳 다섯 군데를 추천해 주세요."),
    ("es", "¿Cuál es la diferencia entre 'ser' y 'estar'? Da ejemplos."),
    ("de", "Erkläre den Unterschied zwischen Wetter und Klima in einfachen Worten."),
    ("ja", "日本の四季について短い文章を書いてください。"),
]

SPEAKERS = ["Priya", "Marcus", "Elena", "Tom", "Aisha", "Jonas", "Wei", "Sofia"]
TOPICS = [
    "the Q3 launch date",
    "the vendor contract for the sensors",
    "hiring for the support team",
    "the onboarding flow",
    "the cloud bill",
    "the pricing page experiment",
    "the mobile release",
    "customer churn in the enterprise tier",
    "the data retention policy",
    "the partner API",
    "the accessibility audit",
    "the warehouse move",
    "the security review",
    "the roadmap for 2025",
]
STANCES = [
    "I think we should postpone {t} by two weeks, because the test results are not stable yet",
    "my concern with {t} is that nobody owns it end to end, so decisions keep bouncing around",
    "the numbers on {t} look better than last month: roughly {n} percent above the target",
    "we agreed last time that {t} would be decided by the end of this sprint, and it still is not",
    "can we split {t} into two parts, a quick fix now and a proper redesign next quarter",
    "I spoke with finance about {t}; they can approve up to {n} thousand euros without a new review",
    "for {t} I would like a written proposal with options, costs and risks before Friday",
    "the customer interviews about {t} were mixed: {n} of the people we talked to liked the change",
    "let us not forget that {t} depends on the legal review, which usually takes about {n} days",
    "I can take the action item for {t} if someone from engineering pairs with me on Thursday",
]


def meeting_transcript(rng: random.Random) -> str:
    """A long planning-meeting transcript: a real-looking prompt of more than 9,000 tokens."""
    lines = []
    minute = 0
    for _ in range(430):
        minute += rng.randint(0, 2)
        stance = rng.choice(STANCES).format(t=rng.choice(TOPICS), n=rng.randint(3, 60))
        lines.append(f"[{minute // 60:02d}:{minute % 60:02d}] {rng.choice(SPEAKERS)}: {stance}.")
    return (
        "Below is the full transcript of our quarterly planning meeting. Summarize it for people "
        "who missed it: list every decision that was made, every open question, and every action "
        "item with its owner. Keep the summary under one page.\n\n" + "\n".join(lines)
    )


def server_log(rng: random.Random) -> str:
    """A pasted log of more than 200,000 characters: the prompt ``too_long_chars`` catches."""
    levels = ["INFO", "INFO", "INFO", "DEBUG", "WARN", "ERROR"]
    events = [
        "GET /api/orders 200",
        "POST /api/cart 201",
        "GET /health 200",
        "db pool size=20 busy=19",
        "retrying upstream call",
        "GET /api/orders 504",
        "cache miss key=user:profile",
    ]
    lines = [
        f"2024-03-0{rng.randint(1, 9)}T{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:"
        f"{rng.randint(0, 59):02d}Z {rng.choice(levels):5s} worker-{rng.randint(1, 8)} {rng.choice(events)}"
        for _ in range(4000)
    ]
    return "Find the root cause of the timeouts in this log:\n" + "\n".join(lines)


def write_infinity_instruct(rng: random.Random, out_dir: Path) -> None:
    rows: list[tuple[list[dict[str, Any]] | None, str]] = []
    for prompt in GENERAL_PROMPTS + CONTEXT_PROMPTS + CODE_PROMPTS_II:
        rows.append(([human(prompt), gpt("(answer)")], "en"))
    rows += [(turns, "en") for turns in MULTI_TURN]
    # The same question again with different whitespace: a duplicate within the source.
    rows.append(
        (
            [
                human(
                    "Explain the difference between  TCP and UDP, and give one application\nwhere each is the better choice. "
                ),
                gpt("(answer)"),
            ],
            "en",
        )
    )
    rows.append(([human(meeting_transcript(rng)), gpt("(summary)")], "en"))
    rows += [([human(text), gpt("(answer)")], lang) for lang, text in NON_ENGLISH]
    bad = [
        [
            human(b"Write a caption for this photo " + LONE_SURROGATE + b" of my dog at the beach."),
            gpt("(caption)"),
        ],
        [human(b"Fix the grammar: 'their going to the park tomorow' " + LONE_SURROGATE), gpt("(fixed)")],
        [{"from": "function", "value": '{"temperature": 21}'}, human("Is that warm?"), gpt("(answer)")],
        [gpt("Hello! How can I help you today?")],
        [human("  \n\t "), gpt("(nothing to answer)")],
        [human(None), gpt("(answer)")],
        [human(server_log(rng)), gpt("(analysis)")],
        None,
    ]
    rows += [(turns, "en") for turns in bad]
    rng.shuffle(rows)
    abilities = [
        "information retrieval",
        "creative writing",
        "programming",
        "logical reasoning",
        "summarization",
    ]
    labels = [
        {
            "ability_en": [rng.choice(abilities)],
            "ability_zh": ["能力"],
            "cate_ability_en": ["general knowledge"],
            "cate_ability_zh": ["通用知识"],
        }
        for _ in rows
    ]
    table = pa.table(
        {
            "id": pa.array(range(3_100_000, 3_100_000 + len(rows)), pa.int64()),
            "conversations": conversations_array([turns for turns, _ in rows]),
            "label": pa.array(labels),
            "langdetect": pa.array([lang for _, lang in rows]),
            "source": pa.array([rng.choice(["sharegpt_like", "code_exercises", "flan_like"]) for _ in rows]),
        }
    )
    write_parquet(table, out_dir / "infinity_instruct/0625/train-00000-of-00001.parquet")


# --- TIGER-Lab/WebInstructSub -----------------------------------------------------------------

WEB_TEMPLATES = [
    ("socratic", "What is the molar mass of {chem}? Show how you add up the atomic masses."),
    (
        "socratic",
        "A ball is thrown straight up at {v} m/s. How high does it rise before it stops? Take g = 9.8 m/s^2.",
    ),
    ("socratic", "How many moles are in {m} g of water?"),
    ("socratic", "What is the pH of a {c} M solution of hydrochloric acid?"),
    ("mathstackexchange", "Prove that the sum of the first {n} odd numbers is a perfect square."),
    ("mathstackexchange", "Find the derivative of $f(x) = x^{n} \\ln(x)$ and state where it is zero."),
    ("mathstackexchange", "Evaluate $\\int_0^{n} x e^{{-x}}\\,dx$."),
    (
        "mathstackexchange",
        "How many ways can {n} people be seated around a round table if rotations are considered the same?",
    ),
    (
        "stackexchange",
        "Why does a {r} ohm resistor get hot when connected to a 9 V battery, and how much power does it dissipate?",
    ),
    (
        "stackexchange",
        "In an economy, nominal GDP grew by {p}% while inflation was 3%. What was real GDP growth approximately?",
    ),
    ("socratic", "A car accelerates from rest to {v} m/s in 8 seconds. What is its average acceleration?"),
    (
        "mathstackexchange",
        "Is the series $\\sum_{{k=1}}^\\infty \\frac{{1}}{{k^{p}}}$ convergent? Justify using a standard test.",
    ),
]
CHEMICALS = [
    "sodium chloride (NaCl)",
    "glucose (C6H12O6)",
    "calcium carbonate (CaCO3)",
    "sulfuric acid (H2SO4)",
    "ammonia (NH3)",
]


def write_webinstructsub(rng: random.Random, out_dir: Path) -> None:
    questions: list[str | bytes | None] = []
    sources = []
    for _ in range(33):
        source, template = rng.choice(WEB_TEMPLATES)
        questions.append(
            template.format(
                chem=rng.choice(CHEMICALS),
                v=rng.randint(5, 40),
                m=rng.randint(9, 180),
                c=rng.choice(["0.01", "0.001", "0.05"]),
                n=rng.randint(3, 12),
                r=rng.choice([10, 47, 100, 220]),
                p=rng.randint(4, 9),
            )
        )
        sources.append(source)
    long_question = (
        "I am studying for an exam in thermodynamics and I keep getting confused by the sign "
        "conventions. In my textbook the first law is written as dU = dQ - dW, but in my lecture "
        "notes it is dU = dQ + dW. A problem asks: a gas in a cylinder absorbs 500 J of heat and "
        "expands, pushing a piston and doing 200 J of work on the surroundings. What is the change "
        "in internal energy? Could you solve it with both conventions, explain why they agree, and "
        "tell me which convention chemists usually prefer and why?"
    )
    extra: list[tuple[str | bytes | None, str]] = [
        (long_question, "stackexchange"),
        (TRAIN_PROBLEM, "socratic"),  # also in MetaMathQA: a cross-source duplicate
        ("   \n  ", "socratic"),
        (None, "mathstackexchange"),
        (b"Simplify \xff(x^2 - 9)/(x - 3) and state the domain.", "mathstackexchange"),
        ("How do I find the inverse of the matrix [[2, 1], [5, 3]]?", "mathstackexchange"),
        ("Why is the sky blue but sunsets are red? Explain with Rayleigh scattering.", "stackexchange"),
    ]
    for question, source in extra:
        questions.append(question)
        sources.append(source)
    order = list(range(len(questions)))
    rng.shuffle(order)
    questions = [questions[i] for i in order]
    sources = [sources[i] for i in order]
    table = pa.table(
        {
            "orig_question": text_array(
                [q.replace(b"\xff", b"") if isinstance(q, bytes) else q for q in questions]
            ),
            "orig_answer": pa.array(["(original forum answer)"] * len(questions)),
            "question": text_array(questions),
            "answer": pa.array(["(step-by-step answer)"] * len(questions)),
            "source": pa.array(sources),
            "index": pa.array(range(len(questions)), pa.int64()),
        }
    )
    write_parquet(table, out_dir / "webinstructsub/data/train-00000-of-00001.parquet")


# --- m-a-p/CodeFeedback-Filtered-Instruction --------------------------------------------------

CODE_TASKS = [
    "reverses the words in a sentence while keeping punctuation attached to its word",
    "returns the n-th Fibonacci number using memoization",
    "merges two sorted lists into one sorted list without using the built-in sort",
    "counts how many times each word appears in a text file and prints the ten most common",
    "validates an email address with a regular expression and explains its limits",
    "removes duplicates from a list while preserving the original order",
    "converts a Roman numeral string to an integer",
    "finds the longest common prefix of a list of strings",
    "checks whether a binary tree is balanced",
    "parses a CSV file and returns the average of a numeric column, skipping bad rows",
    "implements a simple LRU cache with get and put in O(1)",
    "rotates an N x N matrix by 90 degrees in place",
]
LANGUAGES = ["python", "javascript", "java", "go", "rust", "c++", "typescript"]
REVIEW_SNIPPETS = [
    (
        "python",
        (
            "def average(numbers):\n    total = 0\n    for i in range(len(numbers)):\n"
            "        total = total + numbers[i]\n    return total / len(numbers)\n"
        ),
    ),
    (
        "javascript",
        (
            "function fetchUser(id) {\n  let user;\n"
            "  fetch('/api/users/' + id).then(r => r.json()).then(d => { user = d; });\n  return user;\n}\n"
        ),
    ),
    (
        "java",
        (
            "public boolean contains(List<String> items, String target) {\n    for (String s : items) {\n"
            "        if (s == target) return true;\n    }\n    return false;\n}\n"
        ),
    ),
]


def write_codefeedback(rng: random.Random, out_dir: Path) -> None:
    records: list[dict[str, Any]] = []
    for _ in range(30):
        lang = rng.choice(LANGUAGES)
        task = rng.choice(CODE_TASKS)
        style = rng.choice(
            [
                "Write a {lang} function that {task}.",
                "Implement a {lang} program that {task}. Add comments explaining the approach and its time complexity.",
                "I need help writing {lang} code that {task}. Please include unit tests and mention edge cases.",
            ]
        )
        records.append({"query": style.format(lang=lang.capitalize(), task=task), "lang": lang})
    for lang, snippet in REVIEW_SNIPPETS:
        records.append(
            {
                "query": f"Review the following {lang} code. Point out bugs, performance problems and style "
                f"issues, then give a corrected version.\n\n```{lang}\n{snippet}```",
                "lang": lang,
            }
        )
    # The Infinity-Instruct palindrome question with other whitespace: a cross-source duplicate.
    records.append({"query": "  " + PALINDROME.replace(" ", "  ", 3) + "\n", "lang": "python"})
    records += [
        {"query": 4096, "lang": "python"},  # a number where text belongs: datasets keeps it as JSON
        {"query": None, "lang": "go"},
        {"query": "\n\n", "lang": "rust"},
        {
            "query": "Explain the difference between a process and a thread, and when you would use asyncio "
            "instead of threads in Python.",
            "lang": "python",
        },
    ]
    rng.shuffle(records)
    for record in records:
        record["answer"] = "(answer with code)"
        record["resource"] = rng.choice(["evol_instruct_like", "code_alpaca_like", "leetcode_like"])
    write_jsonl(records, out_dir / "codefeedback/CodeFeedback-Filtered-Instruction.jsonl")


# --- meta-math/MetaMathQA ---------------------------------------------------------------------

GSM_TEMPLATES = [
    "A bakery sells muffins for ${a} each and cookies for ${b} each. Maria buys {x} muffins and {y} cookies. How much does she spend?",
    "Tom reads {x} pages on Monday and twice as many on Tuesday. If the book has {z} pages, how many pages are left?",
    "A garden is {x} meters long and {y} meters wide. Fencing costs ${a} per meter. How much does it cost to fence the whole garden?",
    "Sara saves ${a} every week. How many weeks will it take her to save ${z}?",
    "A school has {z} students. {p}% of them take the bus. How many students do not take the bus?",
    "There are {x} red marbles and {y} blue marbles in a bag. What fraction of the marbles are red?",
    "James runs {x} km every weekday and {y} km on Saturday. How many km does he run in 4 weeks?",
]
MATH_TEMPLATES = [
    "What is the remainder when ${z}$ is divided by ${x}$?",
    "Solve for $x$: ${a}x + {b} = {z}$.",
    "What is the sum of all positive divisors of ${x}$?",
    "If $f(x) = {a}x^2 - {b}x + {y}$, what is $f({x})$?",
]
GSM_TYPES = ["GSM_AnsAug", "GSM_Rephrased", "GSM_SV", "GSM_FOBAR"]
MATH_TYPES = ["MATH_AnsAug", "MATH_Rephrased", "MATH_SV", "MATH_FOBAR"]


def write_metamathqa(rng: random.Random, out_dir: Path) -> None:
    records: list[dict[str, Any]] = []
    for _ in range(34):
        if rng.random() < 0.7:
            template, kind = rng.choice(GSM_TEMPLATES), rng.choice(GSM_TYPES)
        else:
            template, kind = rng.choice(MATH_TEMPLATES), rng.choice(MATH_TYPES)
        query = template.format(
            a=rng.randint(2, 9),
            b=rng.randint(1, 5),
            x=rng.randint(3, 40),
            y=rng.randint(2, 30),
            z=rng.randint(100, 999),
            p=rng.choice([20, 25, 40, 60]),
        )
        if kind.endswith("FOBAR"):
            query += " If we know the answer to the above question is 42, what is the value of the unknown variable?"
        records.append({"type": kind, "query": query, "original_question": query})
    records += [
        {"type": "GSM_Rephrased", "query": TRAIN_PROBLEM, "original_question": TRAIN_PROBLEM},
        {"type": "GSM_AnsAug", "query": "", "original_question": "(lost in conversion)"},
        {"type": "MATH_AnsAug", "query": ["What is 7 + 5?"], "original_question": "What is 7 + 5?"},
    ]
    rng.shuffle(records)
    for record in records:
        record["response"] = "(step-by-step solution) The answer is: 42"
    write_json_array(records, out_dir / "metamathqa/MetaMathQA-395K.json")


# --- NousResearch/hermes-function-calling-v1 --------------------------------------------------

TOOLS = {
    "get_current_weather": ("Get the current weather for a city.", {"city": "string", "unit": "string"}),
    "get_stock_price": (
        "Get the latest trading price of a stock by its ticker symbol.",
        {"symbol": "string"},
    ),
    "search_flights": (
        "Search one-way flights between two airports on a date.",
        {"origin": "string", "destination": "string", "date": "string"},
    ),
    "convert_currency": (
        "Convert an amount from one currency to another.",
        {"amount": "number", "from": "string", "to": "string"},
    ),
    "create_calendar_event": (
        "Create a calendar event.",
        {"title": "string", "start": "string", "duration_minutes": "integer"},
    ),
    "search_recipes": (
        "Find recipes that use the given ingredients.",
        {"ingredients": "array", "max_minutes": "integer"},
    ),
    "translate_text": (
        "Translate text into a target language.",
        {"text": "string", "target_language": "string"},
    ),
    "get_exchange_rate": (
        "Get the exchange rate between two currencies.",
        {"base": "string", "quote": "string"},
    ),
}
TOOL_QUESTIONS = {
    "get_current_weather": [
        "What's the weather like in Oslo right now, in Celsius?",
        "Do I need an umbrella in Seattle today?",
    ],
    "get_stock_price": [
        "What is Apple's stock trading at?",
        "Can you check the current price of NVDA for me?",
    ],
    "search_flights": [
        "Find me a flight from Berlin to Madrid on 2024-05-14.",
        "Are there flights from JFK to SFO next Friday, 2024-06-07?",
    ],
    "convert_currency": [
        "How much is 250 euros in Japanese yen?",
        "Convert 1,200 US dollars to British pounds.",
    ],
    "create_calendar_event": [
        "Put a 45-minute dentist appointment in my calendar for tomorrow at 9:30.",
        "Schedule a team retro on 2024-04-12 at 15:00 for one hour.",
    ],
    "search_recipes": [
        "I have chickpeas, spinach and coconut milk. What can I cook in under 30 minutes?",
        "Find a recipe with eggs and leftover rice.",
    ],
    "translate_text": [
        "Translate 'Where is the train station?' into Portuguese.",
        "How do you say 'thank you for your patience' in Korean?",
    ],
    "get_exchange_rate": ["What's the exchange rate from CHF to EUR today?", "Give me the USD to INR rate."],
}
JSON_SCHEMAS = [
    (
        "Character",
        {"name": "string", "age": "integer", "class": "string", "inventory": "array"},
        "Create a fantasy RPG character: a retired pirate turned lighthouse keeper.",
    ),
    (
        "Invoice",
        {"invoice_number": "string", "customer": "string", "items": "array", "total": "number"},
        "Make an invoice for two hours of piano lessons at 40 dollars an hour for Ms. Lee.",
    ),
    (
        "Recipe",
        {"title": "string", "servings": "integer", "ingredients": "array", "steps": "array"},
        "Give me a recipe for a simple tomato soup as JSON.",
    ),
    (
        "MeetingNotes",
        {"date": "string", "attendees": "array", "decisions": "array", "action_items": "array"},
        "Turn this into structured notes: we met on May 3 with Ana and Raj, decided to ship on Friday, Raj will write the release notes.",
    ),
    (
        "BookReview",
        {"title": "string", "author": "string", "rating": "integer", "summary": "string"},
        "Review the novel 'The Old Man and the Sea' in structured form.",
    ),
    (
        "JobPosting",
        {"title": "string", "location": "string", "requirements": "array", "salary_range": "string"},
        "Write a job posting for a junior data engineer in Toronto.",
    ),
]


def tool_signature(name: str) -> str:
    description, params = TOOLS[name]
    schema = {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {k: {"type": t} for k, t in params.items()},
                "required": list(params),
            },
        },
    }
    return json.dumps(schema)


def tools_system_prompt(names: list[str]) -> str:
    return (
        "You are a function calling AI model. You are provided with function signatures within "
        "<tools></tools> XML tags. You may call one or more functions to assist with the user query. "
        "Don't make assumptions about what values to plug into functions.\n<tools>\n"
        + "\n".join(tool_signature(n) for n in names)
        + "\n</tools>\nFor each function call return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags."
    )


def parallel_calls_conversation() -> list[dict[str, Any]]:
    """Two calls in one answer and both results in one tool turn, with the tools written as a Python
    list literal inside <tools>, as many of the dataset's own rows write them."""
    names = ["get_current_weather", "get_exchange_rate"]
    literal = repr([json.loads(tool_signature(n)) for n in names])
    system = tools_system_prompt(names).replace("\n".join(tool_signature(n) for n in names), literal)
    calls = [
        {"name": "get_current_weather", "arguments": {"city": "Lisbon", "unit": "celsius"}},
        {"name": "get_exchange_rate", "arguments": {"base": "EUR", "quote": "USD"}},
    ]
    results = [
        {"name": "get_current_weather", "content": {"temperature": 21, "sky": "clear"}},
        {"name": "get_exchange_rate", "content": {"rate": 1.08}},
    ]
    return [
        {"from": "system", "value": system},
        human("I'm flying to Lisbon tomorrow: what's the weather there, and how many dollars is a euro?"),
        gpt("\n".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>" for c in calls)),
        {
            "from": "tool",
            "value": "\n".join(f"<tool_response>\n{json.dumps(r)}\n</tool_response>" for r in results),
        },
        gpt("It is 21 degrees and clear in Lisbon, and one euro buys 1.08 dollars."),
    ]


def json_system_prompt(title: str, fields: dict[str, str]) -> str:
    schema = {
        "title": title,
        "type": "object",
        "properties": {k: {"type": t} for k, t in fields.items()},
        "required": list(fields),
    }
    return (
        "You are a helpful assistant that answers in JSON. Here's the json schema you must adhere to:\n"
        f"<schema>\n{json.dumps(schema)}\n</schema>"
    )


def tool_conversation(rng: random.Random, *, multi_turn: bool) -> list[dict[str, Any]]:
    main_tool = rng.choice(sorted(TOOLS))
    others = rng.sample(sorted(set(TOOLS) - {main_tool}), 2)
    question = rng.choice(TOOL_QUESTIONS[main_tool])
    turns = [
        {"from": "system", "value": tools_system_prompt(sorted([main_tool, *others]))},
        human(question),
        gpt(f'<tool_call>\n{{"name": "{main_tool}", "arguments": {{}}}}\n</tool_call>'),
    ]
    if multi_turn:
        turns += [
            {
                "from": "tool",
                "value": f'<tool_response>\n{{"name": "{main_tool}", "content": {{"status": "ok"}}}}\n</tool_response>',
            },
            gpt("(answer based on the tool result)"),
            human("Thanks. Can you do the same for tomorrow as well?"),
            gpt("(second tool call)"),
        ]
    return turns


def write_hermes(rng: random.Random, out_dir: Path) -> None:
    shared_row = tool_conversation(random.Random(7), multi_turn=False)
    for config in HERMES_CONFIGS:
        records: list[dict[str, Any]] = []
        json_mode = config.startswith("json_mode")
        for i in range(len(JSON_SCHEMAS) if json_mode else 8):
            if json_mode:
                title, fields, request = JSON_SCHEMAS[i]
                turns = [
                    {"from": "system", "value": json_system_prompt(title, fields)},
                    human(request),
                    gpt('{"...": "..."}'),
                ]
                if config == "json_mode_agentic" and i % 2:
                    turns[1] = human(
                        f"{request} Before answering, think about which fields you can fill from my message."
                    )
                category, subcategory, task = "JSON Schema", title, request[:60]
            else:
                turns = tool_conversation(rng, multi_turn=config == "func_calling" and i % 2 == 0)
                category, subcategory, task = "Function calling", "API call", turns[1]["value"][:60]
            records.append(
                {
                    "id": f"{config}-{i:04d}",
                    "conversations": turns,
                    "category": category,
                    "subcategory": subcategory,
                    "task": task,
                }
            )
        if config in ("func_calling_singleturn", "func_calling"):
            # The same system prompt and question in two configs: a duplicate within the source.
            records.append(
                {
                    "id": f"{config}-shared",
                    "conversations": shared_row,
                    "category": "Function calling",
                    "subcategory": "API call",
                    "task": "shared",
                }
            )
        if config == "func_calling":
            records.append(
                {
                    "id": "func_calling-parallel",
                    "conversations": parallel_calls_conversation(),
                    "category": "Function calling",
                    "subcategory": "Parallel calls",
                    "task": "two calls in one turn",
                }
            )
            # Tool definitions cut off mid-way: quarantined as invalid_tools when conversations are kept.
            broken = tools_system_prompt(["get_stock_price"]).replace('["symbol"]}}}', "[")
            records.append(
                {
                    "id": "func_calling-bad-tools",
                    "conversations": [
                        {"from": "system", "value": broken},
                        human("What is MSFT trading at?"),
                        gpt("..."),
                    ],
                    "category": "Function calling",
                    "subcategory": "API call",
                    "task": "truncated tool definitions",
                }
            )
        if config == "glaive_func_calling":
            records.append(
                {
                    "id": "glaive-bad-role",
                    "conversations": [{"from": "observation", "value": "{}"}, human("What now?")],
                    "category": "Function calling",
                    "subcategory": "API call",
                    "task": "bad role",
                }
            )
        if config == "json_mode_singleturn":
            records.append(
                {
                    "id": "json-no-user",
                    "conversations": [
                        {"from": "system", "value": json_system_prompt("Empty", {"x": "string"})}
                    ],
                    "category": "JSON Schema",
                    "subcategory": "Empty",
                    "task": "no user",
                }
            )
        write_json_array(records, out_dir / f"hermes_function_calling/{config}.json")


# --- THUDM/AgentInstruct ----------------------------------------------------------------------

AGENT_INSTRUCTIONS = {
    "os": (
        "You are an assistant that will act like a person operating a Linux (Ubuntu) shell. For each "
        "turn, first think about what to do, then take exactly one action: run a command with "
        "'Act: bash' followed by the command in a ```bash block, give the final result with "
        "'Act: answer(<answer>)', or stop with 'Act: finish' when the task needs no answer. The "
        "output of each command will be shown to you in the next turn.\n\nNow, my problem is:\n\n"
    ),
    "db": (
        "I will ask you a question, then you should help me operate a MySQL database with SQL to "
        "answer the question. You have to explain the problem and your solution to me and write "
        "down your thoughts. After thinking, write one SQL statement in a ```sql block, with no "
        "other statement. I will show you the result; when you have the final answer, reply with "
        "'Action: Answer' followed by 'Final Answer: [...]'.\n\n"
    ),
    "alfworld": (
        "Interact with a household to solve a task. Imagine you are an intelligent agent in a "
        "household environment and your target is to perform actions to complete the task goal. "
        "At the beginning of your interactions you will be given a detailed description of the "
        "current environment and your goal. For each turn, output 'THOUGHT: ...' and then "
        "'ACTION: ...' using one of: go to [recep], take [obj] from [recep], put [obj] in/on "
        "[recep], open [recep], close [recep], toggle [obj], clean [obj] with [recep], heat [obj] "
        "with [recep], cool [obj] with [recep], examine [obj], inventory, look.\n\n"
    ),
    "webshop": (
        "You are web shopping. I will give you instructions about what to do. You have to follow "
        "the instructions. Every round I will give you an observation and a list of available "
        "actions; you respond with 'Thought: ...' and 'Action: ...'. Valid actions are "
        "search[keywords] and click[value], where value is one of the clickable items.\n\n"
    ),
    "kg": (
        "You are an agent that answers questions over a knowledge base. You can use these tools: "
        "get_relations(variable), get_neighbors(variable, relation), intersection(var1, var2), "
        "get_attributes(variable), argmax(variable, attribute), argmin(variable, attribute), "
        "count(variable). A variable is #0, #1, ... and a tool call returns a new variable. Answer "
        "with 'Final Answer: #n' when the last variable holds the answer.\n\n"
    ),
    "mind2web": (
        "You are a helpful assistant operating a web browser. Given the task and a simplified HTML "
        "of the current page, choose the next element to act on from the listed options and say "
        "which operation to perform (CLICK, TYPE or SELECT) and with which value.\n\n"
    ),
}
AGENT_TASKS = {
    "os": [
        "How many files with the .log extension are there under /var/app, including subdirectories?",
        "Find the process using the most memory and tell me its PID.",
        "Create a user 'backup' whose home directory is /srv/backup.",
        "What is the total size in MB of the directory /opt/data?",
    ],
    "db": [
        "Which employee in the table 'staff' has the highest salary in the Sales department?",
        "How many orders in table 'orders' were placed in March 2023?",
        "Update the price of the product 'Desk Lamp' to 24.99 in table 'products'.",
        "What is the average rating of movies released after 2010 in table 'films'?",
    ],
    "alfworld": [
        "You are in the middle of a room. Looking quickly around you, you see a cabinet 1, a countertop 1, a fridge 1, a sinkbasin 1 and a microwave 1.\nYour task is to: put a clean mug in the coffeemachine.",
        "You are in the middle of a room. You see a bed 1, a desk 1, a drawer 1 and a shelf 1.\nYour task is to: examine the book with the desklamp.",
        "You are in the middle of a room. You see a countertop 1, a fridge 1 and a stoveburner 1.\nYour task is to: heat some egg and put it in the garbagecan.",
        "You are in the middle of a room. You see a sofa 1, a sidetable 1 and a dresser 1.\nYour task is to: find two pillows and put them on the sofa.",
    ],
    "webshop": [
        "WebShop [SEP] Instruction: [SEP] i need a gluten free dark chocolate bar under 10 dollars [SEP] Search",
        "WebShop [SEP] Instruction: [SEP] find me a men's waterproof hiking boot, size 10, price lower than 90.00 dollars [SEP] Search",
        "WebShop [SEP] Instruction: [SEP] i want a pack of 6 unscented soy candles [SEP] Search",
        "WebShop [SEP] Instruction: [SEP] a blue usb-c charging cable, 2 meters, under 15 dollars [SEP] Search",
    ],
    "kg": [
        "Question: which football clubs has the coach of the 2010 world cup winning team managed?\nEntities: [2010 FIFA World Cup]",
        "Question: what is the tallest building designed by the architect of the Burj Khalifa?\nEntities: [Burj Khalifa]",
        "Question: how many moons does the planet discovered by William Herschel have?\nEntities: [William Herschel]",
        "Question: which university did the author of 'Norwegian Wood' attend?\nEntities: [Norwegian Wood]",
    ],
    "mind2web": [
        "Task: Book a table for two at an Italian restaurant in Chicago for Saturday at 7 pm.\nPrevious actions: None\nPage: <button id=0>Reservations</button> <input id=1 placeholder='Location'>",
        "Task: Find the cheapest one-way bus ticket from Boston to New York next Monday.\nPrevious actions: None\nPage: <input id=0 placeholder='From'> <input id=1 placeholder='To'>",
        "Task: Add a 4-pack of AA batteries to the cart.\nPrevious actions: None\nPage: <input id=0 placeholder='Search'> <a id=1>Deals</a>",
        "Task: Subscribe to the weekly newsletter with the email ana@example.com.\nPrevious actions: None\nPage: <a id=0>Newsletter</a> <footer id=1>",
    ],
}


def write_agentinstruct(rng: random.Random, out_dir: Path) -> None:
    for split in AGENT_SPLITS:
        rows: list[list[dict[str, Any]] | None] = []
        for task in AGENT_TASKS[split]:
            rows.append(
                [
                    human(AGENT_INSTRUCTIONS[split] + task),
                    gpt("Think: I should look at the environment first.\n\nAct: (first action)"),
                    human("(observation from the environment)"),
                    gpt("Think: That gives me what I need.\n\nAct: (final action)"),
                ]
            )
        if split == "os":
            rows.append([])  # a trajectory that lost all of its turns
        if split == "webshop":
            rows.append([human(None), gpt("Thought: ...\nAction: search[...]")])
        table = pa.table(
            {
                "conversations": conversations_array(rows, with_loss=True),
                "id": pa.array([f"{split}_{i}" for i in range(len(rows))]),
            }
        )
        write_parquet(table, out_dir / f"agentinstruct/data/{split}-00000-of-00001.parquet")


if __name__ == "__main__":
    main()
