from reverse_words.taskset import ReverseWordsTaskset

__all__ = ["ReverseWordsTaskset"]
