"""How replica groups keep their weights together when not every step: `diloco` (DiLoCo and
Streaming DiLoCo through torchft) and its parts (`diloco_parts`)."""
