"""/metrics of a server of many models: the model table's own series, and every loaded model's usual cobali:*
series with a `model` label (one family per name, the models' samples side by side, as Prometheus expects)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from cobali.frontend.model_table import ModelTable
from cobali.http.state import ServerContext

# The table's totals per model: name, help, and the ModelCounts field holding it.
_COUNTS = (
    ("model_loads", "Times a model was loaded.", "loads"),
    ("model_load_failures", "Times a model failed to load.", "load_failures"),
    ("model_load_seconds", "Time spent loading a model, all its loads together.", "load_seconds"),
    ("model_evictions", "Times a model was unloaded to make room for another.", "evictions"),
    ("model_expirations", "Times a model was unloaded after its keep-alive.", "expirations"),
    ("model_unloads", "Times a model was unloaded by POST /models/unload.", "unloads"),
)


class ModelsCollector(Collector):
    def __init__(self, table: ModelTable, budget_bytes: int,
                 loaded: Callable[[], Iterable[tuple[str, ServerContext]]]) -> None:
        """loaded(): each loaded model's name and context, whose metrics registry is read at scrape time."""
        self.table, self.budget_bytes, self.loaded = table, budget_bytes, loaded

    def collect(self) -> Iterator[Metric]:
        yield from self._table_series()
        families: dict[str, Metric] = {}
        for name, context in self.loaded():
            for family in context.metrics.registry.collect():
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(family.name, family.documentation, family.type,
                                                            family.unit)
                merged.samples.extend(sample._replace(labels={"model": name, **sample.labels})
                                      for sample in family.samples)
        yield from families.values()

    def _table_series(self) -> Iterator[Metric]:
        statuses = self.table.statuses()
        state = GaugeMetricFamily("cobali:model_state", "1 for the state each declared model is in.",
                                  labels=("model", "state"))
        held = GaugeMetricFamily("cobali:model_bytes", "Memory a loaded or loading model holds (measured once "
                                 "loaded, else estimated).", labels=("model",))
        for status in statuses:
            state.add_metric((status.name, status.state), 1)
            if status.state in ("loading", "loaded", "unloading"):
                held.add_metric((status.name,), status.bytes)
        yield state
        yield held
        yield GaugeMetricFamily("cobali:model_resident_bytes", "Memory loaded and loading models hold together.",
                                value=self.table.resident_bytes())
        yield GaugeMetricFamily("cobali:model_memory_budget_bytes", "What loaded models may hold (--models-memory).",
                                value=self.budget_bytes)
        for name, doc, field in _COUNTS:
            family = CounterMetricFamily(f"cobali:{name}", doc, labels=("model",))
            for status in statuses:
                family.add_metric((status.name,), getattr(self.table.counts(status.name), field))
            yield family


def models_registry(collector: ModelsCollector) -> CollectorRegistry:
    """Rendered with prometheus_client's generate_latest at each scrape."""
    registry = CollectorRegistry(auto_describe=False)  # the families are known only at scrape time
    registry.register(collector)
    return registry
