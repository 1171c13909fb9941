"""Reads a TensorBoard event file with the PyPI tensorboard package's own readers and
prints what it found as JSON: the first event's file_version and every scalar as
[tag, step, value]. Used by tests/obs/test_run_outputs.cpp as the oracle for our writer."""
import json
import sys

from tensorboard.backend.event_processing import event_accumulator, event_file_loader

path = sys.argv[1]
events = list(event_file_loader.EventFileLoader(path).Load())
acc = event_accumulator.EventAccumulator(path, size_guidance={event_accumulator.SCALARS: 0})
acc.Reload()
scalars = []
for tag in acc.Tags()["scalars"]:
    for e in acc.Scalars(tag):
        scalars.append([tag, e.step, e.value])
print(json.dumps({"file_version": events[0].file_version, "events": len(events), "scalars": scalars}))
