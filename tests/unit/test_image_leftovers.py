"""What an image build records of the images it made (to remove them once a later build no longer uses them)."""
from ucx_dask_gpu.image import leftovers

LOG = """Step 1/3 : FROM ucx-dask-gpu-builder-base:0.1.0
 ---> 4ea604d9087d
Step 2/3 : COPY ucx/ /build/
 ---> Using cache
 ---> 653fa1981631
Step 3/3 : RUN build.sh
 ---> Running in 0123456789ab
Removing intermediate container 0123456789ab
 ---> 8d3be14fa7c9
Successfully built 8d3be14fa7c9
Successfully tagged ucx-dask-gpu-ucx-stage:0.1.0
"""


def test_every_step_image_is_found_once_and_containers_are_not():
    assert leftovers.step_ids(LOG) == ["4ea604d9087d", "653fa1981631", "8d3be14fa7c9"]


def test_a_missing_or_broken_record_is_empty(tmp_path):
    assert leftovers.read_record(tmp_path) == {"tags": [], "images": []}
    (tmp_path / leftovers.RECORD).write_text("{not json")
    assert leftovers.read_record(tmp_path)["images"] == []
