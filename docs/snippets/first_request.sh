curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \
     -d '{"model": "demo", "prompt": "def main(", "max_tokens": 32}'
