"""The tool and agent sources' samples: hermes-function-calling-v1 and AgentInstruct."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pyarrow as pa

from expansion_dag_tests.workloads.sample_files import (
    conversations_array,
    gpt,
    human,
    write_json_array,
    write_parquet,
)

HERMES_CONFIGS = (
    "func_calling_singleturn",
    "func_calling",
    "glaive_func_calling",
    "json_mode_agentic",
    "json_mode_singleturn",
)
AGENT_SPLITS = ("os", "db", "alfworld", "webshop", "kg", "mind2web")


# --- NousResearch/hermes-function-calling-v1 --------------------------------------------------

TOOLS = {  # name: (description, {parameter: JSON type})
    "get_current_weather": ("Get the current weather for a city.", {"city": "string", "unit": "string"}),
    "get_stock_price": ("Get the latest trading price of a stock by its ticker symbol.", {"symbol": "string"}),
    "search_flights": ("Search one-way flights between two airports on a date.", {"origin": "string", "destination": "string", "date": "string"}),
    "convert_currency": ("Convert an amount from one currency to another.", {"amount": "number", "from": "string", "to": "string"}),
    "create_calendar_event": ("Create a calendar event.", {"title": "string", "start": "string", "duration_minutes": "integer"}),
    "search_recipes": ("Find recipes that use the given ingredients.", {"ingredients": "array", "max_minutes": "integer"}),
    "translate_text": ("Translate text into a target language.", {"text": "string", "target_language": "string"}),
    "get_exchange_rate": ("Get the exchange rate between two currencies.", {"base": "string", "quote": "string"}),
}
TOOL_QUESTIONS = {
    "get_current_weather": ["What's the weather like in Oslo right now, in Celsius?", "Do I need an umbrella in Seattle today?"],
    "get_stock_price": ["What is Apple's stock trading at?", "Can you check the current price of NVDA for me?"],
    "search_flights": ["Find me a flight from Berlin to Madrid on 2024-05-14.", "Are there flights from JFK to SFO next Friday, 2024-06-07?"],
    "convert_currency": ["How much is 250 euros in Japanese yen?", "Convert 1,200 US dollars to British pounds."],
    "create_calendar_event": ["Put a 45-minute dentist appointment in my calendar for tomorrow at 9:30.", "Schedule a team retro on 2024-04-12 at 15:00 for one hour."],
    "search_recipes": ["I have chickpeas, spinach and coconut milk. What can I cook in under 30 minutes?", "Find a recipe with eggs and leftover rice."],
    "translate_text": ["Translate 'Where is the train station?' into Portuguese.", "How do you say 'thank you for your patience' in Korean?"],
    "get_exchange_rate": ["What's the exchange rate from CHF to EUR today?", "Give me the USD to INR rate."],
}
JSON_SCHEMAS = [  # (title, {field: JSON type}, request)
    ("Character", {"name": "string", "age": "integer", "class": "string", "inventory": "array"}, "Create a fantasy RPG character: a retired pirate turned lighthouse keeper."),
    ("Invoice", {"invoice_number": "string", "customer": "string", "items": "array", "total": "number"}, "Make an invoice for two hours of piano lessons at 40 dollars an hour for Ms. Lee."),
    ("Recipe", {"title": "string", "servings": "integer", "ingredients": "array", "steps": "array"}, "Give me a recipe for a simple tomato soup as JSON."),
    ("MeetingNotes", {"date": "string", "attendees": "array", "decisions": "array", "action_items": "array"}, "Turn this into structured notes: we met on May 3 with Ana and Raj, decided to ship on Friday, Raj will write the release notes."),
    ("BookReview", {"title": "string", "author": "string", "rating": "integer", "summary": "string"}, "Review the novel 'The Old Man and the Sea' in structured form."),
    ("JobPosting", {"title": "string", "location": "string", "requirements": "array", "salary_range": "string"}, "Write a job posting for a junior data engineer in Toronto."),
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
