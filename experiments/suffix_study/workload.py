"""A repetitive workload for suffix decoding: requests made from a few task templates with
different inputs, the way agent loops, extraction pipelines and text-to-SQL services look
(SuffixDecoding, arXiv:2411.04975, evaluates on such workloads: AgenticSQL, SWE-bench agents).

    python -m experiments.suffix_study.workload --out=/tmp/workload.jsonl --n=96 --seed=0

Each template fixes the instruction and the answer's shape; the inputs come from small pools,
drawn with a seeded NumPy generator, so a request's prompt and answer share long stretches with
earlier requests of its template but are not copies of them. Deterministic: the same seed gives
the same requests.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

NAMES = ["Ada Lovelace", "Alan Turing", "Grace Hopper", "Edsger Dijkstra", "Barbara Liskov", "Donald Knuth",
         "Frances Allen", "John McCarthy", "Margaret Hamilton", "Ken Thompson", "Radia Perlman", "Leslie Lamport"]
CITIES = ["London", "Paris", "Berlin", "Madrid", "Rome", "Vienna", "Prague", "Lisbon", "Dublin", "Oslo"]
YEARS = [str(y) for y in range(1950, 2021, 5)]
DEPARTMENTS = ["sales", "research", "support", "finance", "marketing", "legal"]
ITEMS = ["laptop", "monitor", "keyboard", "desk chair", "headset", "webcam", "printer", "tablet"]
TOPICS = ["the weather in {city}", "flights from {city} to {city2}", "museums in {city}", "hotels near {city} station",
          "the population of {city}", "train times from {city} to {city2}"]

TEMPLATES = {
    "sql": ("You translate requests into SQL for the table employees(id, name, department, salary, city, hired). "
            "Answer with the SQL query only.\nRequest: list the names of the employees in {dept} who live in {city} "
            "and were hired after {year}, ordered by salary."),
    "sql_count": ("You translate requests into SQL for the table employees(id, name, department, salary, city, "
                  "hired). Answer with the SQL query only.\nRequest: count the employees of the {dept} department "
                  "in {city}."),
    "extract": ("Extract the person's name, city and year from the sentence as JSON with the keys \"name\", "
                "\"city\" and \"year\". Answer with the JSON only.\nSentence: In {year}, {name} moved to {city} "
                "to start a new job."),
    "tool": ("You are an agent with one tool, search(query). Reply with the tool call as JSON "
             "{{\"tool\": \"search\", \"query\": \"...\"}} and nothing else.\nUser: I need to know about {topic}."),
    "order": ("Write a short, polite order confirmation email for {name}, who ordered a {item} to be delivered "
              "in {city}. Use the subject line 'Your order is confirmed'."),
    "summary": ("Summarize in one sentence: {name} was born in {city} in {year} and became known for work on "
                "computing in the {dept} field."),
}


def request(template: str, rng: np.random.Generator) -> str:
    city, city2 = rng.choice(CITIES, 2, replace=False)
    values = dict(name=rng.choice(NAMES), city=city, city2=city2, year=rng.choice(YEARS),
                  dept=rng.choice(DEPARTMENTS), item=rng.choice(ITEMS))
    values["topic"] = rng.choice(TOPICS).format(**values)
    return TEMPLATES[template].format(**values)


def make(n: int, seed: int) -> list[dict]:
    """n requests, templates in a seeded random order (each template about n / 6 times)."""
    rng = np.random.default_rng(seed)
    names = list(TEMPLATES)
    order = rng.permutation(np.resize(np.arange(len(names)), n))
    return [{"id": i, "template": names[t], "prompt": request(names[t], rng)} for i, t in enumerate(order)]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--n", type=int, default=96)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    with open(a.out, "w") as f:
        for r in make(a.n, a.seed):
            f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
