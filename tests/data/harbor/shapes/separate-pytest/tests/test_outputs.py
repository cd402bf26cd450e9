from pathlib import Path


def test_greeting_file_exists():
    assert Path("/app/greeting.txt").exists()


def test_greeting_content():
    assert Path("/app/greeting.txt").read_text().strip() == "Hello, Harbor!"
