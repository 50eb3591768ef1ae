import openai

client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
print(client.completions.create(model="demo", prompt="import os\n", max_tokens=32).choices[0].text)
