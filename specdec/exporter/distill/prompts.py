"""The user-style prompts `specdec distill` asks the target to answer (its training data).

Two sources. Templates x topics, drawn deterministically for a seed: varied in task
(explain, list, story, advice, compare, how-to, email, code, ...) and topic; held-out
prompts use topics that no training prompt uses, and nothing here may overlap the bench's
or the tests' prompts (tests/distill checks it): topics those use are left out on purpose.
And user turns the target writes itself (data.write_user_turns), for the variety 32
templates lack; `keep_user_turns` filters those as they come, against the same rules.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

import numpy as np

TEMPLATES = (
    "Explain {t} in simple terms.",
    "What is {t}? Answer in a short paragraph.",
    "Give me three interesting facts about {t}.",
    "Write a short story that involves {t}.",
    "List the pros and cons of {t}.",
    "How would you explain {t} to a child?",
    "Write a haiku about {t}.",
    "What are common misconceptions about {t}?",
    "Write a short blog post introduction about {t}.",
    "Summarize the history of {t} in a few sentences.",
    "Give me tips for beginners interested in {t}.",
    "Write a friendly message to a colleague about {t}.",
    "What questions should I ask an expert on {t}?",
    "Describe {t} in exactly five sentences.",
    "Why do people care about {t}?",
    "Write a product description for something related to {t}.",
    "Create a short quiz with answers about {t}.",
    "What is the future of {t}?",
    "Write a dialogue between two friends discussing {t}.",
    "Give a step-by-step plan to learn about {t}.",
    "Write a limerick about {t}.",
    "Compare {t} with something similar and explain the differences.",
    "What would happen if {t} disappeared tomorrow?",
    "Write a tweet announcing news about {t}.",
    "Give me a one-paragraph argument in favour of {t}.",
    "Give me a one-paragraph argument against {t}.",
    "Explain the main ideas behind {t} with an example.",
    "Write an outline for a presentation on {t}.",
    "Tell me a joke about {t}.",
    "I am curious about {t}. Where should I start?",
    "Write a short Python function related to {t} and explain it.",
    "Write a diary entry from someone who loves {t}.",
)

TOPICS = (
    "volcanoes", "the water cycle", "black holes", "honey bees", "the printing press", "electric cars",
    "chess", "jazz music", "the stock market", "recycling", "meditation", "the Moon landing",
    "coffee", "bread baking", "the human heart", "rainforests", "solar panels", "ancient Egypt",
    "the Internet", "vaccines", "origami", "marathon running", "public transport", "the Olympic Games",
    "dinosaurs", "photography", "gardening", "the French Revolution", "earthquakes", "cloud computing",
    "sharks", "the immune system", "board games", "renewable energy", "libraries", "bicycles",
    "the Great Wall of China", "tea", "machine learning", "deserts", "birds migrating", "the piano",
    "mountain climbing", "submarines", "the periodic table", "friendship", "learning a new language",
    "budgeting money", "sleep", "video games", "museums", "penguins", "time zones", "rain",
    "the Renaissance", "3D printing", "camping", "cheese", "trains", "the Amazon river", "comets",
    "robots in factories", "vegetarian cooking", "the Eiffel Tower", "snow", "elephants", "podcasts",
    "DNA", "lighthouses", "volunteering", "spreadsheets", "the Sahara", "octopuses", "windmills",
    "social media", "the Silk Road", "bridges", "knitting", "the solar system", "fungi", "kites",
    "hot air balloons", "composting", "climate change", "the ocean tides", "airplanes", "yoga",
    "chocolate", "the violin", "bees and flowers", "wolves", "typewriters", "magnets", "glaciers",
    "city parks", "cryptography", "soap", "fireworks", "coral", "the guitar", "pottery", "owls",
    "password security", "the Vikings", "maps", "the immune response to colds", "skateboarding",
    "rice farming", "smartphones", "whales", "the human brain", "caves", "lightning", "clocks",
    "the Industrial Revolution", "dolphins", "desert plants", "antibiotics", "satellites", "frogs",
)
HELDOUT_TOPICS = (
    "rainbows", "the Byzantine Empire", "beekeeping", "quantum computers", "tigers", "sourdough",
    "hurricanes", "the saxophone", "space stations", "mushrooms", "ballet", "ice hockey",
    "the Pacific Ocean", "paper money", "bats", "wind turbines",
)


def training_prompts(count: int, seed: int) -> list[str]:
    """Return `count` distinct training prompts (templates x TOPICS), in a seeded random order."""
    pairs = [(t, topic) for t in TEMPLATES for topic in TOPICS]
    order = np.random.default_rng(seed).permutation(len(pairs))
    return [pairs[i][0].format(t=pairs[i][1]) for i in order[: min(count, len(pairs))]]


def heldout_prompts(count: int, seed: int) -> list[str]:
    """Return `count` held-out prompts (templates x HELDOUT_TOPICS: topics no training prompt has)."""
    pairs = [(t, topic) for t in TEMPLATES for topic in HELDOUT_TOPICS]
    order = np.random.default_rng(seed + 1).permutation(len(pairs))
    return [pairs[i][0].format(t=pairs[i][1]) for i in order[: min(count, len(pairs))]]


_WORD = re.compile(r"[a-z0-9']+")
# Words every request shares: two prompts alike only in these are not about the same thing.
_GENERIC = frozenset("""a an the and or but of to in on at for with about from by as is are was be it its this that
these those i me my you your we our they them he she his her can could would should will do does did please
write give tell explain describe list make create what how why who when where which some any one two three
four five few short simple more most very also just into than then there""".split())


def _words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def _shingles(words: list[str], n: int) -> set[tuple[str, ...]]:
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def bench_prompts() -> list[tuple[str, str]]:
    """Return (group, prompt) for every prompt of the bench's shipped prompt sets (none if they are not installed)."""
    from specdec.data import HELDOUT_PROMPTS_FILE, PROMPTS_FILE

    rows = []
    for path in (PROMPTS_FILE, HELDOUT_PROMPTS_FILE):
        if Path(path).is_file():
            rows += [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    return [(row.get("group", "open"), row["prompt"]) for row in rows]


def keep_user_turns(turns: Iterable[str], avoid: list[tuple[str, str]], avoid_topics: Iterable[str],
                    seen: set[str]) -> list[str]:
    """Return the target-written user turns fit to train on, in order; `seen` gains their normalised text.

    Dropped: too short or too long to be a request (12-400 characters, 3+ words), repeats of
    one already kept (`seen`), any sharing a 4-word phrase with a prompt in `avoid` (group,
    prompt), sharing two or more non-generic words with an open one there (a bench prompt's
    topic: "why is the sky blue" against "explain why the sky is blue to a ten year old"),
    and any naming one of `avoid_topics` (the held-out topics stay unseen).
    """
    avoid_phrases = set().union(*(_shingles(_words(prompt), 4) for _, prompt in avoid)) if avoid else set()
    avoid_words = [set(_words(prompt)) - _GENERIC for group, prompt in avoid if group == "open"]
    topics = [re.compile(rf"\b{re.escape(topic.lower())}\b") for topic in avoid_topics]
    kept = []
    for turn in turns:
        text = turn.strip()
        words = _words(text)
        key = " ".join(words)
        if not 12 <= len(text) <= 400 or len(words) < 3 or key in seen:
            continue
        content = set(words) - _GENERIC
        if (_shingles(words, 4) & avoid_phrases or any(len(content & other) >= 2 for other in avoid_words)
                or any(topic.search(key) for topic in topics)):
            continue
        seen.add(key)
        kept.append(text)
    return kept
