"""The CPU backend: OpenBLAS, single forwards, where a decode step's time goes, CPU per streamed token, the default dtype."""
