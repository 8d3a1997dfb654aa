"""The attention weights of the two worked examples (fastattn demo --plot)."""
from fastattn import demo

demo.weights_figure()
