"""The backends that compute checksums from piece views: a Triton kernel and a torch CPU path."""
