"""The prompts of the speculative-decoding benchmarks (``spec_decode_cpu``, ``spec_replay``), by set.

``copy-edit`` (the default): requests the bundled model (SmolLM2-135M-Instruct, greedy, bf16)
answers by returning its input, copied or edited: a rename or a one-line fix in a 20-30 line
Python function, a paragraph with one word replaced, a JSON object of 13-16 fields with one value
changed. Each is a chat with a system message asking for the whole edited input and nothing
else, and one short example exchange of its kind (few-shot).

The rule they were chosen by, not by tok/s: ten candidates were written first (four code edits,
three rewrites, three JSON changes) and answered once, greedy, up to 256 tokens; a candidate was
kept if at least 80% of its output is its input copied in order (``spec_replay.copied_share``:
matching blocks of 4+ tokens between the prompt and the output). Nine were kept, at 0.88-1.00.
The one dropped, an ``LRUCache`` class with an attribute to rename, fell into repeating one line
(0.35). The model seldom makes the edit asked for (most outputs are the input verbatim; the fix
and the rewrites drop or merge a few lines), which is still an answer by copying its input.

``v1``: the first set, single user messages. The bundled model does not answer most of them by
copying: it rewrites the code, explains it in new prose and restructures the JSON.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

_CODE_ORDERS = '''\
def summarize_orders(orders, tax_rate):
    totals = {}
    count = 0
    for order in orders:
        customer = order["customer"]
        amount = order["amount"]
        if amount <= 0:
            continue
        taxed = amount * (1 + tax_rate)
        if customer not in totals:
            totals[customer] = 0.0
        totals[customer] += taxed
        count += 1
    best = None
    best_total = 0.0
    for customer, total in totals.items():
        if total > best_total:
            best = customer
            best_total = total
    average = sum(totals.values()) / len(totals) if totals else 0.0
    return {
        "count": count,
        "best": best,
        "best_total": round(best_total, 2),
        "average": round(average, 2),
    }'''

_CODE_MERGE = '''\
def merge_intervals(intervals, gap=0):
    """Merge overlapping or nearly touching [start, end] intervals."""
    if not intervals:
        return []
    ordered = sorted(intervals, key=lambda pair: pair[0])
    merged = [list(ordered[0])]
    for start, end in ordered[1:]:
        last = merged[-1]
        if start < last[1] + gap:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    result = []
    for start, end in merged:
        if end < start:
            raise ValueError("interval ends before it starts")
        result.append((start, end))
    total = 0
    for start, end in result:
        total += end - start
    print("merged", len(intervals), "intervals into", len(result))
    print("covered length:", total)
    return result'''

_CODE_STATS = '''\
def describe(values, precision=2):
    if not values:
        raise ValueError("values must not be empty")
    ordered = sorted(values)
    count = len(ordered)
    total = sum(ordered)
    mean = total / count
    middle = count // 2
    if count % 2 == 1:
        median = ordered[middle]
    else:
        median = (ordered[middle - 1] + ordered[middle]) / 2
    squares = 0.0
    for value in ordered:
        squares += (value - mean) ** 2
    variance = squares / count
    spread = ordered[-1] - ordered[0]
    return {
        "count": count,
        "mean": round(mean, precision),
        "median": round(median, precision),
        "variance": round(variance, precision),
        "min": ordered[0],
        "max": ordered[-1],
        "spread": spread,
    }'''

_JSON_ORDER = '''\
{
  "order_id": "A-10293",
  "customer": "Maria Lopez",
  "email": "maria.lopez@example.com",
  "phone": "+34 612 345 678",
  "street": "Calle Mayor 12",
  "city": "Madrid",
  "postal_code": "28013",
  "country": "Spain",
  "items": 3,
  "subtotal": 89.5,
  "shipping": 4.99,
  "total": 94.49,
  "currency": "EUR",
  "status": "pending",
  "gift_wrap": false,
  "notes": "Leave at the front desk"
}'''

_JSON_SERVER = '''\
{
  "host": "db01.internal",
  "port": 5432,
  "database": "inventory",
  "user": "app_reader",
  "pool_size": 10,
  "timeout_seconds": 30,
  "retries": 3,
  "ssl": true,
  "log_level": "info",
  "region": "eu-west-1",
  "replica": "db02.internal",
  "backup_hour": 3,
  "maintenance_day": "sunday"
}'''

_JSON_USER = '''\
{
  "id": 48213,
  "username": "tkowalski",
  "first_name": "Tomasz",
  "last_name": "Kowalski",
  "email": "t.kowalski@example.org",
  "language": "pl",
  "timezone": "Europe/Warsaw",
  "plan": "basic",
  "storage_gb": 50,
  "two_factor": true,
  "newsletter": false,
  "created": "2021-03-14",
  "last_login": "2024-11-02",
  "theme": "dark"
}'''

_PARA_TRIP = (
    'On Monday morning the team left the office early and drove to the coast for the annual '
    'planning retreat. The weather was cold but clear, and the small hotel by the harbour had '
    'prepared a long table in the dining room. After lunch they reviewed the results of the '
    'past year, argued about the roadmap, and agreed to hire two more engineers before the '
    'summer. In the evening they walked along the beach, ate fish and chips on the pier, and '
    'talked about everything except work. Most of them drove back the next day, tired but '
    'happy with what they had decided.'
)

_PARA_GARDEN = (
    'The community garden opened in April after two years of planning. Volunteers built '
    'twelve raised beds from old timber, laid gravel paths between them, and installed a rain '
    'barrel next to the shed. Each bed is shared by two families, who take turns watering it '
    'during the week. The garden committee meets on the first Saturday of every month to plan '
    'the planting, sort out the tools, and decide who looks after the compost. Last season '
    'the beds produced more tomatoes than anyone could eat, so the extra harvest was given to '
    'the food bank on Market Street.'
)

_PARA_LIB = (
    'The city library will move to its new building on Harbour Road next spring. The old '
    'building, which has served readers for more than eighty years, will close at the end of '
    'February so that the books can be packed and moved. During the move, a small reading '
    'room will stay open in the town hall, with newspapers, a few computers and a selection '
    "of popular novels. The new library has three floors, a children's section with its own "
    'garden, and study rooms that can be booked online. Members do not need to renew their '
    'cards, and all loans will be extended until the new building opens.'
)

_SYSTEM = ("You are a precise editor. Apply the requested change and return the whole edited "
           "input, unchanged everywhere else. Return only the edited input, with no explanation.")

# One example exchange per kind of edit (the few-shot turn before the request).
_SHOTS: Mapping[str, tuple[str, str]] = MappingProxyType({
    "code": ("Rename the function `area` to `rect_area`.\n\n```python\ndef area(w, h):\n"
             "    if w < 0 or h < 0:\n        raise ValueError(\"negative size\")\n"
             "    return w * h\n```",
             "```python\ndef rect_area(w, h):\n    if w < 0 or h < 0:\n"
             "        raise ValueError(\"negative size\")\n    return w * h\n```"),
    "text": ("Replace the word \"red\" with \"blue\".\n\nShe painted the door red and the window "
             "frames white, then sat in the garden to watch it dry.",
             "She painted the door blue and the window frames white, then sat in the garden to "
             "watch it dry."),
    "json": ("Change \"size\" to \"L\".\n\n{\n  \"item\": \"shirt\",\n  \"size\": \"M\",\n"
             "  \"price\": 19.9\n}",
             "{\n  \"item\": \"shirt\",\n  \"size\": \"L\",\n  \"price\": 19.9\n}"),
})


@dataclass(frozen=True, slots=True)
class Prompt:
    """One benchmark request: a name and the chat messages, as ``(role, content)`` pairs."""

    name: str
    messages: tuple[tuple[str, str], ...]

    def __post_init__(self) -> None:
        if not self.messages or self.messages[-1][0] != "user":
            raise ValueError(f"messages of prompt {self.name!r} must end with a user message.")

    def chat(self) -> list[dict[str, str]]:
        return [{"role": role, "content": content} for role, content in self.messages]


def _edit(name: str, kind: str, request: str) -> Prompt:
    """A ``copy-edit`` prompt: the system message, the example of ``kind``, then ``request``."""
    shot_request, shot_answer = _SHOTS[kind]
    return Prompt(name, (("system", _SYSTEM), ("user", shot_request), ("assistant", shot_answer),
                         ("user", request)))


def _code(name: str, edit: str, code: str) -> Prompt:
    return _edit(name, "code", f"{edit} Return only the edited code.\n\n```python\n{code}\n```")


_COPY_EDIT = (
    _code("code-rename", "Rename the variable `totals` to `per_customer`.", _CODE_ORDERS),
    _code("code-fix", "Fix the bug: `start < last[1] + gap` must be `start <= last[1] + gap`.",
          _CODE_MERGE),
    _code("code-param", "Rename the parameter `precision` to `digits`.", _CODE_STATS),
    _edit("text-trip", "text", "Replace the word \"Monday\" with \"Friday\". Return only the "
          f"edited paragraph.\n\n{_PARA_TRIP}"),
    _edit("text-garden", "text", "Replace \"twelve\" with \"fifteen\". Return only the edited "
          f"paragraph.\n\n{_PARA_GARDEN}"),
    _edit("text-library", "text", "Replace \"spring\" with \"autumn\". Return only the edited "
          f"paragraph.\n\n{_PARA_LIB}"),
    _edit("json-order", "json", "Change \"status\" to \"shipped\". Return only the edited "
          f"JSON.\n\n{_JSON_ORDER}"),
    _edit("json-server", "json", f"Change \"port\" to 6432. Return only the edited JSON.\n\n{_JSON_SERVER}"),
    _edit("json-user", "json", "Change \"plan\" to \"premium\". Return only the edited "
          f"JSON.\n\n{_JSON_USER}"),
)

V1_TEXTS = (
    "Rename the variable `total` to `running_sum` in this Python function and return the whole "
    "function:\n\n```python\ndef add_all(values):\n    total = 0\n    for value in values:\n"
    "        total = total + value\n    return total\n```",
    "Add type hints to this function and return the whole code:\n\n```python\n"
    "def scale(points, factor):\n    result = []\n    for x, y in points:\n"
    "        result.append((x * factor, y * factor))\n    return result\n```",
    'Change the "city" of this JSON object to "Paris" and return the whole object:\n\n'
    '{"name": "Alice Martin", "age": 34, "city": "London", "email": "alice@example.com", '
    '"skills": ["python", "sql", "docker"], "active": true}',
    "Rewrite this paragraph replacing every occurrence of 'car' with 'bicycle':\n\n"
    "The car was parked near the station. Every morning the car took her to work, and in the "
    "evening the car brought her back home. She loved her car.",
    "Convert this list into a JSON array of objects with keys name and price:\n\n"
    "apple 1.20\nbanana 0.50\ncherry 3.10\ndate 2.75\nelderberry 4.00",
)

PROMPT_SETS: Mapping[str, tuple[Prompt, ...]] = MappingProxyType({
    "copy-edit": _COPY_EDIT,
    "v1": tuple(Prompt(f"v1-{i}", (("user", text),)) for i, text in enumerate(V1_TEXTS)),
})
DEFAULT_PROMPT_SET = "copy-edit"


def prompt_set(name: str) -> tuple[Prompt, ...]:
    """The prompts of set ``name``; an unknown name raises ValueError naming the sets."""
    prompts = PROMPT_SETS.get(name)
    if prompts is None:
        raise ValueError(f"prompt_set must be one of {', '.join(PROMPT_SETS)}, got {name!r}.")
    return prompts
