"""FLARE's Flower ClientApp (`flare.flower.client_app:app`).

A node answers `train` messages by training the asked rounds on its own data with `protocol.client_train`, and
replies with its weights, sample count, class histogram and training logs. Between per-round messages its client
state waits in `context.state`. After its last round it keeps its upload there too, and answers the `query`
messages of a server strategy that holds rounds with the clients after the upload (`handle_query`: FENS). The node
config keys are docs/federation.md's.
"""
from __future__ import annotations

import json

import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from flare.errors import FlareError
from flare.flower.protocol import ClientResult, LocalData, Task, client_talk, client_train, file_data, partition_data
from flare.flower.records import pack_nested, record_to_state, state_to_record, unpack_nested

app = ClientApp()

_INIT, _CARRY, _CARRY_SKELETON = "flare.init", "flare.carry", "flare.carry-skeleton"
_TRAINED, _MEMORY = "flare.trained", "flare.memory."  # after the last round: the upload; a strategy's memory


def _node_int(node_config, key: str):
    v = node_config.get(key)
    if v is None:
        return None
    try:
        return int(v)
    except (TypeError, ValueError):
        raise FlareError(f"node config {key}={v!r} is not an integer.", key=key) from None


def local_data(task: Task, context: Context) -> LocalData:
    """This node's own samples: from its `data-path`, or its part of the run's split (`partition-id`)."""
    cfg, nc = task.cfg, context.node_config
    cid = _node_int(nc, "partition-id")
    if cid is None:
        raise FlareError("this node has no partition-id in its node config.", key="partition-id",
                         fix="start it with --node-config 'partition-id=I ...' (I = its client id).")
    k = _node_int(nc, "num-partitions")
    if k is not None and k != cfg.num_clients:
        raise FlareError(f"this node was started with num-partitions={k}, the run has num_clients={cfg.num_clients}.",
                         key="num-partitions", fix="give every node num-partitions equal to num_clients.")
    if nc.get("data-path"):
        return file_data(str(nc["data-path"]), cid, task.meta)
    if where := {k2: str(nc[k1]) for k1, k2 in (("dataset-root", "root"), ("cache-dir", "cache_dir")) if nc.get(k1)}:
        cfg = cfg.model_copy(update={"dataset": cfg.dataset.model_copy(update=where)})
    return partition_data(cfg, cid)


def handle_train(content: RecordDict, context: Context) -> RecordDict:
    """One train instruction → the reply content (engine-free apart from the record types)."""
    task = Task.from_config(content.config_records["task"])
    local, state, nc = local_data(task, context), context.state, context.node_config
    if task.round_start == 0:
        for key in [k for k in state.keys() if k.startswith("flare.")]:  # an earlier run's
            del state[key]
    elif _INIT not in state or _CARRY not in state:
        raise FlareError(f"asked to train from round {task.round_start}, but this node holds no state "
                         "from earlier rounds (it restarted?).")
    init_rec = content.array_records.get("init") if task.round_start == 0 else state[_INIT]
    resume = unpack_nested(state[_CARRY], str(state[_CARRY_SKELETON]["skeleton"])) if task.round_start > 0 else None
    sent = content.array_records.get("sent")
    res: ClientResult = client_train(task, local, dict(record_to_state(init_rec)) if init_rec is not None else {},
                                     resume=resume, received=dict(record_to_state(sent)) if sent is not None else None,
                                     device=str(nc["device"]) if nc.get("device") else None)

    if res.carry is not None:  # more rounds will come: keep what the next message needs
        state[_INIT] = init_rec
        state[_CARRY], skeleton = pack_nested(res.carry)
        state[_CARRY_SKELETON] = ConfigRecord({"skeleton": skeleton})
    else:
        for key in (_INIT, _CARRY, _CARRY_SKELETON):
            state.pop(key, None)
        if res.state is not None:  # the trained model, for the rounds a server strategy may hold after the upload
            state[_TRAINED] = state_to_record(res.state)

    reply = RecordDict()
    if res.state is not None:
        reply["upload"] = state_to_record(inject_fault(res.state, nc.get("fault")))
    if res.extras:
        reply["extras"] = state_to_record(inject_fault(res.extras, nc.get("fault"), extras=True))
    reply["meta"] = ConfigRecord({"client": res.cid, "num-samples": res.num_samples,
                                  "class-histogram": [int(h) for h in res.class_histogram],
                                  "records": json.dumps(res.records, default=float)})
    reply["metrics"] = MetricRecord({"num-examples": res.num_samples})
    return reply


def handle_query(content: RecordDict, context: Context) -> RecordDict:
    """One round a server strategy holds with the clients after their upload: its message in, this client's reply
    out; the strategy's memory for this client waits in `context.state` between rounds."""
    task = Task.from_config(content.config_records["task"])
    talk = content.config_records["talk"]
    name, rnd = str(talk["strategy"]), int(talk["round"])
    state, nc = context.state, context.node_config
    if _TRAINED not in state:
        raise FlareError(f"asked for round {rnd + 1} of server strategy '{name}', but this node holds no trained "
                         "model (it restarted, or never finished training).")
    key = _MEMORY + name
    if rnd == 0:
        state.pop(key, None)
    memory = dict(record_to_state(state[key])) if key in state else {}
    reply = client_talk(task, local_data(task, context), record_to_state(state[_TRAINED]), name, rnd,
                        dict(record_to_state(content.array_records["message"])), memory,
                        device=str(nc["device"]) if nc.get("device") else None)
    state[key] = state_to_record(memory)
    return RecordDict({"reply": state_to_record(reply)})


FAULTS = ("wrong-shape", "nan", "missing-key", "extras-shape")


def inject_fault(state: dict, fault, extras: bool = False) -> dict:
    """Fault drills (node config `fault=...`): a deliberately broken upload, to exercise the server's gate on a
    real deployment. `extras-shape` breaks the first statistic in the extras record, the others the weights."""
    if not fault:
        return state
    if fault not in FAULTS:
        raise FlareError(f"node config fault={fault!r} is not a fault drill.", key="fault",
                         fix=f"use one of: {', '.join(FAULTS)} (or leave it unset).")
    if (fault == "extras-shape") != extras:
        return state
    out = dict(state)
    if extras:
        name = next(iter(out))
        out[name] = torch.cat([out[name].reshape(-1), out[name].reshape(-1)[:1]])
        return out
    name = next(k for k, v in out.items() if v.is_floating_point() and v.dim() >= 2)
    if fault == "wrong-shape":
        out[name] = out[name][:1].clone()
    elif fault == "nan":
        out[name] = out[name].clone().fill_(float("nan"))
    else:
        del out[name]
    return out


@app.train()
def train(msg: Message, context: Context) -> Message:
    return Message(content=handle_train(msg.content, context), reply_to=msg)


@app.query()
def query(msg: Message, context: Context) -> Message:
    return Message(content=handle_query(msg.content, context), reply_to=msg)
