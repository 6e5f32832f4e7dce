"""`nxdc bench`: latency/throughput of exports, optionally against transformers."""
