"""Typed engine messages: what crosses the frontend <-> engine-core socket is MessagePack of the structs in
deepinfer.engine.messages, and a frame of any other shape, even one signed with the right key, is dropped and
logged, never executed."""

from __future__ import annotations

import logging
import pickle
from pathlib import Path

import msgspec
import pytest

from deepinfer.engine import SettingsBackend
from deepinfer.frontend import LLMEngine
from deepinfer.engine import messages as m
from deepinfer.engine import startup
from deepinfer.engine.ipc import CORE, FRONTEND, HEARTBEAT, Signer, Verifier, new_key
from deepinfer.sampling import SamplingParams
from deepinfer.sampling.logprobs import SampleOutput
from options_helpers import engine_options, settings_for

MODEL = str(Path(__file__).parent / "fixtures" / "deepseek_v41" / "tiny-swa-csa2")
PROMPT = [0, 5, 6, 7]


class _Payload:
    """Unpickling it writes a marker file: what a pickle-based receiver would execute."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (Path.write_text, (Path(self.path), "pwned"))


def _signed_raw(key: bytes, label: bytes, seq: int, payload: bytes) -> bytes:
    """A correctly signed frame around an arbitrary payload (Signer would only ever encode a message)."""
    from deepinfer.engine.ipc import _mac

    n = seq.to_bytes(8, "big")
    return _mac(key, label, n, payload) + n + payload


def test_messages_round_trip_with_their_types():
    params = SamplingParams(temperature=0.5, stop=["x"], so_args={"schema_type": "json", "schema": {"type": "object"}},
                            golden_token_ids=[3, 4], seq_seed=7)
    key = new_key()
    frame = Signer(key, FRONTEND).pack(m.to_wire([m.AddRequest(1, [0, 5], params, 9, client="10.0.0.7")]))
    msg = Verifier(key, FRONTEND, m.TO_CORE).unpack(frame)
    assert isinstance(msg, m.Add)
    req = m.from_wire(msg.requests[0])
    assert req == m.AddRequest(1, [0, 5], params, 9, client="10.0.0.7") and isinstance(req.params, SamplingParams)
    assert m.from_wire(m.WireRequest(2, [0], {}, 0, [], client=[1])).client == ""  # a tag, never an error

    upd = m.RequestUpdate(1, [5], [(-0.5, [(5, -0.5), (6, -1.0)])], "stop", None,
                          [None, SampleOutput(5, -1.25, None)], num_draft_tokens=3, num_accepted_tokens=2,
                          busy=True)
    stats = m.StepStats(0, 1, 2, 0, 0, 1.0, 2.0, 0.1, 0.1, 0.1, 0.5, accepted_lengths=[2], replay_rows_saved=4)
    frame = Signer(key, CORE).pack(m.Outputs(m.CoreOutputs([upd], [stats])))
    out = Verifier(key, CORE, m.TO_FRONTEND).unpack(frame).outputs
    assert out.updates == [upd] and out.updates[0].logprobs[0][1] == [(5, -0.5), (6, -1.0)]
    assert out.stats[0].accepted_lengths == [2] and out.stats[0].kernels == stats.kernels


@pytest.mark.parametrize("payload", [
    pytest.param("pickle", id="a pickle"),
    pytest.param(msgspec.msgpack.encode({"kind": "add", "requests": [{"request_id": "x"}]}), id="wrong types"),
    pytest.param(msgspec.msgpack.encode({"kind": "exec", "code": "import os"}), id="unknown kind"),
    pytest.param(msgspec.msgpack.encode({"kind": "ping", "extra": 1}), id="unknown field"),
    pytest.param(b"\xc1\xff\x00", id="not msgpack"),
])
def test_a_signed_frame_that_is_not_a_message_is_rejected_and_logged_never_executed(payload, tmp_path, caplog):
    marker = tmp_path / "marker"
    if payload == "pickle":
        payload = pickle.dumps(("add", _Payload(marker)))
    key = new_key()
    core_in = Verifier(key, FRONTEND, m.TO_CORE)
    with caplog.at_level(logging.WARNING, logger="deepinfer.engine.ipc"):
        assert core_in.unpack(_signed_raw(key, FRONTEND, 1, payload)) is None
    assert core_in.rejected == 1 and not marker.exists()
    assert "dropped a signed frontend frame that is not a valid message" in caplog.text
    # the channel still works: the next genuine message is accepted
    assert core_in.unpack(_signed_raw(key, FRONTEND, 2, msgspec.msgpack.encode(m.Ping()))) == m.Ping()


def test_a_hostile_frame_on_the_live_engine_socket_is_dropped_and_the_engine_keeps_serving(tmp_path):
    """A correctly signed pickle, sent on the core's own connection, reaches the real engine-core process: it must
    be dropped there (not unpickled: no marker file), and the engine answers the next requests as before."""
    marker = tmp_path / "marker"
    greedy = SamplingParams(temperature=0, max_tokens=3)
    with LLMEngine.for_settings(settings_for(MODEL, process="subprocess", memory_budget=1 << 22)) as eng:
        before = eng.generate([PROMPT], greedy, use_tqdm=False)[0].token_ids
        client = eng.client
        evil = pickle.dumps(("add", _Payload(marker)))
        client._signer._seq += 1  # a valid signature and a fresh sequence number: only decoding can stop it
        frame = _signed_raw(client._signer._key, FRONTEND, client._signer._seq, evil)
        client._sock.send_multipart([client._core_id, frame])
        wrong = msgspec.msgpack.encode({"kind": "abort", "request_ids": "all"})
        client._signer._seq += 1
        client._sock.send_multipart([client._core_id, _signed_raw(client._signer._key, FRONTEND, client._signer._seq, wrong)])
        # one connection delivers in order: the core has read (and dropped) both frames before the next request
        assert eng.generate([PROMPT], greedy, use_tqdm=False)[0].token_ids == before
    assert not marker.exists()


def test_the_start_up_message_is_typed_and_a_plain_callable_cannot_cross():
    from deepinfer.engine.backend import backend_from_model

    key = new_key()
    settings = settings_for(MODEL)
    args = startup.CoreStartup(startup.describe(SettingsBackend(settings)), engine_options(max_num_seqs=3),
                               "ipc:///a", "ipc:///b", key, 42)
    back = startup.decode(startup.encode(args))
    assert back.options == args.options and back.options.max_num_seqs == 3 and back.key == key
    assert startup.factory_from(back.backend) == SettingsBackend(settings)  # rebuilt through the config's checks
    with pytest.raises(TypeError, match="typed description.*got function.*engine.process=inproc"):
        startup.describe(lambda: None)
    with pytest.raises(TypeError, match="typed description: SettingsBackend.*got function"):
        startup.describe(backend_from_model)  # a model built in memory runs in-process only
    with pytest.raises(msgspec.ValidationError):
        startup.decode(pickle.dumps(args.options))
    with pytest.raises(TypeError, match="typed description"):
        LLMEngine(lambda: None, engine_options(process="subprocess"))


def test_resolved_settings_cross_as_data_and_come_back_equal():
    from deepinfer.api import load_settings

    settings = load_settings(["runtime.seed=5", "sampling.stop=[x]"])
    spec = startup.decode(startup.encode(startup.CoreStartup(startup.describe(SettingsBackend(settings)),
                                                             engine_options(), "a", "b", b"k", 1))).backend
    assert startup.factory_from(spec).settings == settings
