"""The chat-style sources' samples: Infinity-Instruct, WebInstructSub, CodeFeedback and MetaMathQA."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pyarrow as pa

from expansion_dag_tests.workloads.sample_files import (
    conversations_array,
    gpt,
    human,
    text_array,
    write_json_array,
    write_jsonl,
    write_parquet,
)

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
