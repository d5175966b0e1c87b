"""A stand-in shopper understanding that reads like the product: derived from the prompt's activity log.

The simulator is not a language model, but the first thing a new user sees (``make demo``) is its
answers, and word salad does not show what the pipeline is for. When a request asks for the shopper
understanding schema (``prompt_assembly.understanding``), the answer is computed from the log lines the
prompt carries (``prompt_assembly.prompt.render_event`` format): the dominant categories weighted by
intent (a purchase counts more than a cart add, a cart add more than a click or a view), the price band
of what the shopper looked at, an occasion guessed from what went into the cart or was bought, and a
style from the product words. Deterministic (same prompt, same answer), schema-valid, and labelled as a
stand-in in its summary.
"""

from __future__ import annotations

import re
import statistics
from collections import Counter
from collections.abc import Mapping
from typing import Any

STAND_IN_LABEL = "(simulator stand-in)"
UNDERSTANDING_KEYS = frozenset({"interests", "occasion", "style", "price_sensitivity", "summary"})

_LINE = re.compile(
    r"^- \d{4}-\d{2}-\d{2} \d{2}:\d{2} (?P<verb>viewed|clicked|added to cart|purchased)(?: x\d+)?: "
    r"<data>(?P<title>.*?)</data>(?: by <data>.*?</data>)?, "
    r"(?:<data>(?P<category>.*?)</data>|(?P<bare_category>[^,]*)), \$(?P<price>[0-9.]+)\s*$"
)
_SEARCH = re.compile(r"^- \d{4}-\d{2}-\d{2} \d{2}:\d{2} searched <data>(?P<query>.*?)</data>\s*$")
_WEIGHT = {"viewed": 1, "clicked": 2, "added to cart": 4, "purchased": 6}

# (words in cart or purchased titles/categories, occasion): first match wins.
_OCCASIONS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("kids", "child", "toddler", "dress-up"), "a child's costume for a school parade or party"),
    (("candy", "chocolate", "lollipop", "gummy", "treat"), "handing out treats to trick-or-treaters"),
    (("pet", "dog", "cat"), "dressing up a pet for Halloween"),
    (("outdoor", "yard", "lawn", "porch", "inflatable"), "decorating the yard for Halloween"),
    (("indoor", "decor", "garland", "centerpiece", "lights", "mantel"), "decorating the home for a party"),
    (("costume", "cosplay", "makeup", "blood", "face paint"), "a Halloween costume party"),
)
_STYLES: tuple[tuple[tuple[str, ...], str], ...] = (
    (
        ("zombie", "blood", "skeleton", "werewolf", "haunted", "tombstone", "vampire", "gothic"),
        "spooky, scary",
    ),
    (("unicorn", "superhero", "astronaut", "dinosaur", "hot dog", "onesie"), "playful, kid-friendly"),
    (("inflatable", "light-up", "animated", "giant"), "eye-catching, big statement pieces"),
    (("victorian", "elegant", "candle", "raven", "deluxe"), "classic, elegant"),
)


def is_understanding_schema(schema: Mapping[str, Any] | None) -> bool:
    properties = (schema or {}).get("properties")
    return isinstance(properties, Mapping) and set(properties) >= UNDERSTANDING_KEYS


def shopper_understanding(log_text: str) -> dict[str, Any]:
    """The understanding of the shopper whose activity log is ``log_text`` (a prompt's user message)."""
    weights: Counter[str] = Counter()
    committed: Counter[str] = Counter()  # title and category of cart adds and purchases -> weight
    words: list[str] = []
    prices: list[float] = []
    searches: list[str] = []
    carts = purchases = 0
    for line in log_text.splitlines():
        if match := _LINE.match(line):
            verb, title, category = (
                match["verb"],
                match["title"],
                (match["category"] or match["bare_category"]).strip(),
            )
            weights[category] += _WEIGHT[verb]
            prices.append(float(match["price"]))
            words.append(f"{title} {category}".lower())
            if verb in ("added to cart", "purchased"):
                committed[f"{title} {category}".lower()] += _WEIGHT[verb]
                carts += verb == "added to cart"
                purchases += verb == "purchased"
        elif match := _SEARCH.match(line):
            searches.append(match["query"].strip().lower())
    interests = (
        [_interest(category) for category, _ in weights.most_common(3)] or searches[:2] or ["browsing"]
    )
    occasion = _weighted_match(_OCCASIONS, committed)
    style = _first_match(_STYLES, words) or "practical, mainstream picks"
    sensitivity = _price_sensitivity(prices)
    summary = _summary(interests, occasion, sensitivity, len(words), carts, purchases)
    return {
        "interests": list(dict.fromkeys(i[:60] for i in interests))[:5],
        "occasion": occasion,
        "style": style,
        "price_sensitivity": sensitivity,
        "summary": summary,
    }


def _interest(category: str) -> str:
    """'Costumes > Kids' -> 'kids costumes'; a flat category is kept as it is."""
    parts = [p.strip().lower() for p in category.split(">") if p.strip()]
    if len(parts) >= 2:
        sub = parts[-1]
        if " " not in sub and sub.endswith("s") and not sub.endswith("ss"):
            sub = sub[:-1]  # 'Costumes > Kids' reads 'kid costumes'
        return f"{sub} {parts[0]}"
    return parts[0] if parts else "uncategorised products"


def _first_match(rules: tuple[tuple[tuple[str, ...], str], ...], texts: list[str]) -> str | None:
    joined = " ".join(texts)
    for keys, label in rules:
        if any(key in joined for key in keys):
            return label
    return None


def _weighted_match(rules: tuple[tuple[tuple[str, ...], str], ...], texts: Counter[str]) -> str | None:
    """The label whose keywords the heaviest items match (ties: the earlier rule)."""
    scores: Counter[str] = Counter()
    for text, weight in texts.items():
        label = _first_match(rules, [text])
        if label is not None:
            scores[label] += weight
    if not scores:
        return None
    order = {label: i for i, (_, label) in enumerate(rules)}
    return max(scores, key=lambda label: (scores[label], -order[label]))


def _price_sensitivity(prices: list[float]) -> str:
    if not prices:
        return "medium"
    median = statistics.median(prices)
    return "high" if median < 15 else "low" if median > 60 else "medium"


def _summary(
    interests: list[str], occasion: str | None, sensitivity: str, events: int, carts: int, purchases: int
) -> str:
    intent = (
        ", ".join(_count(n, noun) for n, noun in ((purchases, "purchase"), (carts, "cart add")) if n)
        or "browsing only"
    )
    budget = {"high": "budget-minded", "medium": "mid-priced", "low": "premium"}[sensitivity]
    purpose = f", likely for {occasion}" if occasion else ""
    seen = _count(events, "product")
    text = f"Shops {interests[0]}{purpose}; {budget} ({seen} seen, {intent}). {STAND_IN_LABEL}"
    if len(text) > 240:
        text = text[: 240 - len(STAND_IN_LABEL) - 2].rstrip() + "… " + STAND_IN_LABEL
    return text


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
