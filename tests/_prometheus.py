"""Prometheus text (`GET /metrics`) as a dict for tests: each sample's name with its labels -> its value."""


def prometheus_samples(text: str) -> dict[str, float]:
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
