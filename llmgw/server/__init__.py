"""The control plane: inventory, store, placement, reconciler, services, gRPC-web bridge."""
