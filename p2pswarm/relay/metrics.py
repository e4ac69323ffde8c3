"""The relay's Prometheus metrics (``GET /metrics`` on its health port), read from the same
report as ``/health`` at scrape time, so the two never disagree.

    p2pswarm_relay_reservations                  reservations held now
    p2pswarm_relay_reservations_granted_total    reservations granted (renewals included)
    p2pswarm_relay_circuits                      circuits open now
    p2pswarm_relay_circuits_opened_total         circuits spliced
    p2pswarm_relay_bytes_relayed_total           bytes carried through circuits
    p2pswarm_relay_tokens_accepted_total         node tokens accepted
    p2pswarm_relay_refusals_total{reason}        reservations and circuits refused, by reason
    p2pswarm_relay_dht_peers                     peers in the relay's DHT routing table
"""
from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_GAUGES = (("reservations", "Reservations held now"), ("circuits", "Circuits open now"),
           ("dht_peers", "Peers in the relay's DHT routing table"))
_COUNTERS = (("reservations_granted", "Reservations granted (renewals included)"),
             ("circuits_opened", "Circuits spliced"), ("bytes_relayed", "Bytes carried through circuits"),
             ("tokens_accepted", "Node tokens accepted"))


class _RelayCollector:
    def __init__(self, report):
        self.report = report

    def collect(self):
        h = self.report()
        for key, doc in _GAUGES:
            yield GaugeMetricFamily(f"p2pswarm_relay_{key}", doc, value=h[key])
        for key, doc in _COUNTERS:
            yield CounterMetricFamily(f"p2pswarm_relay_{key}", doc, value=h[key])
        refusals = CounterMetricFamily("p2pswarm_relay_refusals", "Reservations and circuits refused, by reason",
                                       labels=["reason"])
        for reason, n in sorted(h["refusals"].items()):
            refusals.add_metric([reason], n)
        yield refusals


def relay_metrics(report) -> tuple[bytes, str]:
    """Prometheus text for one health ``report()`` (a fresh registry: nothing accumulates here)."""
    registry = CollectorRegistry()
    registry.register(_RelayCollector(report))
    return generate_latest(registry), CONTENT_TYPE_LATEST
