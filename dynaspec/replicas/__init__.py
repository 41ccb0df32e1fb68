"""Engine replicas on Ray Serve behind one OpenAI-compatible ingress (`dynaspec serve --replicas N`)."""
