"""The user-style prompts `specdec distill` asks the target to answer (its training data).

Templates x topics, drawn deterministically for a seed: varied in task (explain, list,
story, advice, compare, how-to, email, code, ...) and topic. Held-out prompts use topics
that no training prompt uses. Nothing here may overlap the bench's or the tests' prompts
(tests/distill checks it): topics those use are left out on purpose.
"""

from __future__ import annotations

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
