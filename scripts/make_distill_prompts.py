"""Write specdec/data/distill_prompts.jsonl: the prompts `specdec distill` samples the target on.

Why a script: the held-out figures of a distilled draft are measured on prompts whose
topics it never trained on, and a draft fits the topics it saw (the shipped draft of
2026-12-03 reached α 0.424 on fresh samples of its training prompts, 0.358 on the held-out
ones). More topics, each used a few times, make more of its data about language and less
about one topic. This script keeps every prompt the file already holds (the 30 held-out
ones unchanged, so figures stay comparable across releases) and adds training prompts:
each new topic in a few of the topic templates, coding tasks in a few languages and
phrasings, and everyday chat requests. It refuses a new prompt that names a held-out topic.

Run from the repository root: python scripts/make_distill_prompts.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

PROMPTS = Path(__file__).resolve().parent.parent / "specdec" / "data" / "distill_prompts.jsonl"
SEED = 0
TEMPLATES_PER_TOPIC = 4

TOPIC_TEMPLATES = [
    "What are the main facts everyone should know about {}?",
    "Make a bulleted list of questions a student might ask about {}.",
    "Write a short paragraph about {}.",
    "Why is {} important?",
    "Give me three pros and three cons of {}.",
    "What are four common misconceptions about {}?",
    "Describe the history of {} in a few sentences.",
    "List the key steps to learn about {}.",
    "Summarize what you know about {} in two sentences.",
    "Explain {} in simple terms.",
    "Give a tweet-length summary of {}.",
    "List five interesting facts about {}.",
    "What is {}? Give a short explanation.",
    "Write a one-paragraph summary of {} for a newsletter.",
    "Can you explain how {} works to a ten-year-old?",
    "Write a short poem about {}.",
]

TOPICS = [
    # nature and science
    "bees", "rainforests", "deserts", "hurricanes", "the moon", "Mars", "comets", "the Milky Way", "DNA",
    "vaccines", "the heart", "sharks", "whales", "elephants", "migratory birds", "mushrooms", "soil erosion",
    "the ozone layer", "lightning", "snowflakes", "caves", "rivers", "wetlands", "ant colonies", "butterflies",
    "the human skeleton", "sound waves", "magnetism", "electricity", "friction", "the speed of light",
    "atoms", "chemical reactions", "evolution", "fossils", "genetics", "bacteria", "viruses", "the nervous system",
    "nutrition", "vitamins", "the digestive system", "sleep cycles", "allergies", "the solar system", "telescopes",
    "the Big Bang", "gravity waves", "ocean currents", "seasons", "the rock cycle", "clouds", "wildfires",
    "tsunamis", "deep sea creatures", "penguins", "wolves", "honey", "trees", "seeds", "pollination",
    # technology
    "smartphones", "the internet of things", "artificial intelligence", "robots", "3D printing", "electric cars",
    "self-driving cars", "satellites", "GPS", "cybersecurity", "passwords", "encryption", "databases",
    "open-source software", "video games", "virtual reality", "email", "search engines", "social media",
    "computer viruses", "microchips", "fiber optics", "Wi-Fi", "cloud storage", "spreadsheets", "drones",
    "the printing of money", "barcodes", "radio", "television", "the telephone", "cameras", "refrigerators",
    "bicycles", "trains", "bridges", "skyscrapers", "dams", "lighthouses", "canals", "elevators",
    # history and society
    "ancient Egypt", "the Vikings", "the Industrial Revolution", "the Olympic Games", "the Maya civilization",
    "the Cold War", "the Moon landing", "medieval castles", "the samurai", "ancient Greece", "the Aztecs",
    "the abolition of slavery", "women's suffrage", "the United Nations", "the Magna Carta", "pirates",
    "the gold rush", "the Age of Exploration", "the invention of writing", "the Bronze Age", "the Ottoman Empire",
    "the Berlin Wall", "the history of medicine", "the postal service", "public transportation", "elections",
    "taxes", "human rights", "city planning", "museums", "universities", "newspapers", "the census",
    # economy and everyday life
    "budgeting", "credit cards", "interest rates", "small businesses", "supply and demand", "online shopping",
    "remote work", "job interviews", "time management", "minimalism", "recycling at home", "composting",
    "gardening", "cooking with spices", "baking bread", "coffee", "tea", "cheese making", "fermentation",
    "vegetarian diets", "food waste", "first aid", "meditation", "yoga", "running", "swimming", "cycling",
    "chess openings", "board games", "photography", "painting", "jazz", "classical music", "hip hop",
    "film making", "theater", "poetry", "libraries", "learning a new language", "public speaking",
    "volunteering", "pets", "dog training", "houseplants", "mountain climbing", "sailing",
    "soccer", "basketball", "tennis", "the Tour de France", "the World Cup", "sign language", "handwriting",
    "origami", "knitting", "woodworking", "electric guitars", "pianos", "dance", "architecture", "fashion",
]

CODE_TEMPLATES = [
    "Write a {lang} function that {task}.",
    "Show me {lang} code that {task}, with a short explanation.",
    "How do I write a function in {lang} that {task}?",
]
LANGUAGES = ["Python", "Python", "Python", "JavaScript", "C", "Go", "Rust", "Java"]
CODE_TASKS = [
    "sums the even numbers in a list", "removes duplicates from a list", "counts the vowels in a string",
    "checks whether a number is prime", "returns the factorial of a number", "flattens a nested list",
    "merges two dictionaries", "finds the second largest number in a list", "converts a string to title case",
    "checks whether a year is a leap year", "computes the average of a list of numbers",
    "reverses the words in a sentence", "finds the most common element in a list", "splits a list into chunks",
    "validates an email address", "converts a binary string to an integer", "computes the power set of a set",
    "counts how often each word appears in a text", "parses a date string", "generates a random password",
    "implements bubble sort", "implements a queue with two stacks", "finds the longest word in a sentence",
    "checks whether parentheses are balanced", "computes the dot product of two vectors",
    "transposes a matrix", "finds all prime numbers below n", "converts kilometers to miles",
    "reads a text file and prints each line", "writes a list of numbers to a file",
    "sorts a list of strings by length", "computes a running total of a list", "finds the intersection of two lists",
    "checks whether a list is sorted", "removes whitespace from a string", "counts the digits of an integer",
    "formats a number with thousands separators", "computes the greatest common divisor of two numbers",
    "implements a simple linked list", "finds the missing number in a list from 1 to n",
    "converts a dictionary to JSON", "computes the area of a circle", "returns the n-th triangular number",
    "groups words by their first letter", "finds pairs in a list that add up to a target",
    "computes compound interest", "shuffles a list", "checks whether a string contains only digits",
]

CHAT = [
    "Hi! How are you today?", "Can you recommend a good book for a long flight?", "What should I name my cat?",
    "Write a thank-you note to my teacher.", "How can I get better at waking up early?",
    "Give me some ideas for a rainy weekend.", "What is a healthy breakfast I can make in five minutes?",
    "Help me write an apology message to a friend.", "How do I start learning to draw?",
    "What are some fun games to play with kids at home?", "Write a short speech for my sister's wedding.",
    "How do I keep my houseplants alive?", "Suggest three hobbies I can start this month.",
    "What is a polite way to ask my neighbor to be quieter?", "Write a haiku about autumn.",
    "Tell me a joke about computers.", "How do I prepare for my first 5k run?",
    "Can you help me write a cover letter for a bakery job?", "What should I bring to a picnic?",
    "How do I make my small apartment feel bigger?", "Write a limerick about a dog who loves pizza.",
    "Give me tips for a job interview over video.", "What are some good questions to ask on a first date?",
    "How can I be more productive when working from home?", "Write a short story about a lost robot.",
    "Plan a relaxing Sunday for me.", "How do I explain my job to my grandparents?",
    "What is a nice gift for a coworker who is leaving?", "Help me write a message to cancel a meeting.",
    "How do I make friends in a new city?", "Suggest a name for my bakery.", "Write a short poem about the ocean.",
    "What are good habits for saving money?", "How do I stay calm before an exam?",
    "Give me a simple recipe for tomato soup.", "What can I cook with rice, eggs and spinach?",
    "Write a funny birthday card for my brother.", "How do I clean a cast iron pan?",
    "Tell me a bedtime story about a sleepy owl.", "What are some ways to reduce stress at work?",
    "Help me plan a budget for a weekend trip.", "How do I ask for a raise?",
    "Write a welcome message for new members of my book club.", "Give me five ideas for a science fair project.",
    "What are easy exercises I can do at my desk?", "How should I organize my closet?",
    "Write a motivational quote for my team.", "Describe a perfect summer day.",
    "Can you summarize the plot of a fairy tale you like?", "What is a good routine before going to sleep?",
    "How do I teach my kid to ride a bike?", "Write an out-of-office email reply.",
    "How do I choose a good laptop for school?", "Suggest a menu for a dinner party of six.",
    "Write a short review of an imaginary restaurant.", "What are tips for taking better phone photos?",
    "How can I reduce my screen time?", "Write a riddle and give its answer.",
    "Plan a two-day trip to Paris for me.", "What should I pack for a beach holiday?",
    "How do I politely say no to extra work?", "Write a short note to welcome a new neighbor.",
]

# Topics and tasks of the held-out prompts (the "eval" split): never in a new training prompt.
HELD_OUT_TOPICS = [
    "glacier", "silk road", "quantum", "octopus", "marathon training", "renaissance", "wind turbine",
    "chocolate", "submarine", "human brain", "median", "rotates a matrix", "capitalizes", "anagram",
    "good evening", "limerick about a cat", "decline an invitation", "rome", "camping trip", "grandmother",
]


def new_prompts(existing: set[str]) -> list[str]:
    """The prompts this script adds, in a seeded order, none already in `existing`."""
    rng = random.Random(SEED)
    made = []
    for topic in TOPICS:
        made += [template.format(topic) for template in rng.sample(TOPIC_TEMPLATES, TEMPLATES_PER_TOPIC)]
    for task in CODE_TASKS:
        for template in rng.sample(CODE_TEMPLATES, 2):
            made.append(template.format(lang=rng.choice(LANGUAGES), task=task))
    made += CHAT
    kept, seen = [], set(existing)
    for prompt in made:
        lowered = prompt.lower()
        bad = [topic for topic in HELD_OUT_TOPICS if topic in lowered]
        if bad:
            raise SystemExit(f"new prompt {prompt!r} names the held-out topic {bad[0]!r}")
        if prompt not in seen:
            kept.append(prompt)
            seen.add(prompt)
    return kept


def main() -> None:
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    added = [{"prompt": prompt, "split": "train"} for prompt in new_prompts({row["prompt"] for row in rows})]
    PROMPTS.write_text("".join(json.dumps(row) + "\n" for row in rows + added))
    train = sum(row.get("split") != "eval" for row in rows + added)
    print(f"{PROMPTS}: {train} training prompts ({len(added)} added), {len(rows) + len(added) - train} held out")


if __name__ == "__main__":
    main()
