"""fusedserve: planned, fused-communication LLM serving on Kubernetes."""
