from rbln_ray.client import RBLNClient

client = RBLNClient("demo")  # joins this host's `rbln-ray serve` (or RAY_ADDRESS) if needed
for delta in client.stream("def main(", max_tokens=32):
    print(delta, end="", flush=True)
