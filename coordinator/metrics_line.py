"""Where the group's metrics are served, in one line for `spill up`, `spill status` and `spill run`."""

NOT_SERVED = "metrics: not served"


def metrics_line(served: bool, host: str, port: int) -> str:
    """`served`: the endpoint was bound (the telemetry's server is up); a port in use says how to pick another."""
    if port == 0:
        return "metrics: none (port 0)"
    if served:
        return f"metrics: http://{host}:{port}/metrics"
    return (f"{NOT_SERVED}: {host}:{port} is in use (another spill group or program); start the group with "
            "`spill up --metrics-port PORT`, or set SPILL_METRICS_PORT for a `spill run` that starts its own")
