"""One UCX installation (a prefix, the libucx wheel, or the tools on PATH), its tools `ucx_info` and `ucx_perftest`,
and `doctor`. install, info and perftest are standard library only: the UCX build imports them with a bare python3."""
