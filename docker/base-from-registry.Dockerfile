# The image's two bases from a registry's Debian image, for sites that can pull one (instead of debootstrap + import):
#   ucx-dask-gpu image base --from debian:bookworm-slim@sha256:<digest>
# builds the runtime base (stack.toml [debian].base_packages) and the builder base (+ ucx_build_packages +
# builder_packages) from this file; the package lists arrive as PACKAGES, none is written here. These two builds
# need the network (apt); the image build on top of them still runs with --network none.
ARG DEBIAN_IMAGE
FROM ${DEBIAN_IMAGE}
ARG PACKAGES
# No apt lists, caches or logs left in the layer.
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends ${PACKAGES} \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/cache/apt/archives/*.deb /var/log/apt /var/log/dpkg.log \
        /var/log/alternatives.log
