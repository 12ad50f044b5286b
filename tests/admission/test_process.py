"""The admission actor's pricing of a job's model, resident or streamed."""

import structlog

from spill import messages as m
from spill.admission.process import _price
from spill.streamer.plan import load_plan


def test_a_resident_reset_prices_every_layer_as_fixed_and_leaves_less_kv(make_tiny):
    folder = str(make_tiny("llama"))
    args, log = {"memory": "2GB"}, structlog.get_logger()
    streamed, _, _ = _price(m.Reset(1, folder, "job"), args, None, log)
    resident, _, _ = _price(m.Reset(1, folder, "job", resident=True), args, None, log)
    assert resident.sheet.fixed["resident"] == 2 * load_plan(folder).total_bytes   # bf16, computed in float32
    assert resident.sheet.fixed["layers"] == 0 < streamed.sheet.fixed["layers"]
    assert resident.sheet.kv_budget < streamed.sheet.kv_budget
