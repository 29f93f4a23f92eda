"""Read Prometheus text format the way a scraper does (prometheus_client.parser)."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def parse(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of every sample in ``text``."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def scrape(url: str, *, timeout: float = 5.0) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return parse(response.read().decode())


def value(samples: dict, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))
