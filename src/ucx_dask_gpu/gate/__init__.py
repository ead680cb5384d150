"""The environment gate: every Dask role carries its identity (stack id + packages), the scheduler refuses a peer
whose stack id differs (the guard preload), workers close quietly, and the dask config that loads both."""
