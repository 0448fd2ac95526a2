"""Gang scheduling: the labels and annotations that make every pod of an RLJob one gang, and
one Kueue pod group when ``spec.scheduling.queueName`` is set."""

from __future__ import annotations

from rljob_operator.layout import Layout
from rljob_operator.names import LABEL_GANG


def gang(layout: Layout) -> tuple[dict[str, str], dict[str, str]]:
    """Pod labels and annotations that make every pod of the RLJob one gang."""
    pod_labels = {LABEL_GANG: layout.name}
    annotations: dict[str, str] = {}
    if layout.spec.scheduling.queue_name:
        pod_labels["kueue.x-k8s.io/queue-name"] = layout.spec.scheduling.queue_name
        pod_labels["kueue.x-k8s.io/pod-group-name"] = layout.name
        annotations["kueue.x-k8s.io/pod-group-total-count"] = str(layout.total_pods)
    return pod_labels, annotations
